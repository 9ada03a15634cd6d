"""`MpiBackend`: each op of the `Backend` interface as MPI nonblocking calls run through the group's `Channel`.

Arrays go to MPI as they are (NumPy buffers, zero-copy; a non-contiguous array through a contiguous copy), under a
dtype MPI has for the bytes (`library.wire_view`). Device arrays go straight to a CUDA-aware MPI library. Low-precision
reductions run in float32 and round once (`library`). Before each collective the members compare their calls
(`Channel.start_check`, `MpiOptions.check_calls`), so that a different op, dtype, size or root raises on every rank:
before the op's requests start, or, between two members, with the op's own messages tagged with the call (`plans`).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.backends.base import Array, Backend, BackendOptions, Signature, signature
from axond.distributed.backends.host_arrays import output_array, scatter_rows
from axond.distributed.backends.mpi import plans
from axond.distributed.backends.mpi.channel import Channel, Check, group_comm
from axond.distributed.backends.mpi.library import INSTALL, available, cuda_aware, mpi, reduce_op, wire_view
from axond.distributed.backends.mpi.options import SPIN, MpiOptions
from axond.distributed.backends.mpi.p2p import PointToPoint
from axond.distributed.backends.splits import announcement, check_splits, offsets, settle
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, check_reduce_op, finish_average, narrow_into, wide_dtype
from axond.distributed.ops import DTYPES, OP_NAMES, REDUCE_CODES, UNEVEN_ALL_TO_ALL, Op, dtype_code
from axond.errors import DistributedError
from axond.store import Store

MAX_NDIM = 32
"""Dimensions a scattered array may have (its shape travels in a fixed header)."""


def spin_for(comm: Any, timeout: float, group_name: str, rank: int) -> int:
    """`SPIN`, or 0 where the members on this host (MPI_COMM_TYPE_SHARED) outnumber the cores they may run on: the
    union of their affinities, since a launcher that binds each rank to a core of its own (mpirun does) leaves each
    process one core, and one that does not leaves each all of them."""
    local = comm.Split_type(mpi().COMM_TYPE_SHARED)
    try:
        cpus = np.zeros(CPU_MASK_BYTES * 8, bool)
        cpus[[c for c in os.sched_getaffinity(0) if c < cpus.size]] = True
        mine = np.packbits(cpus)
        masks = np.empty((local.Get_size(), CPU_MASK_BYTES), np.uint8)
        request = local.Iallgather(mine, masks)  # once per group, at its creation
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                _STUCK.append((request, mine, masks))  # MPI may still write them: kept until the process ends
                raise DistributedError(f"init of the mpi backend on group '{group_name}': timed out after {timeout:g} "
                                       "s comparing the cores of this host's members: a member did not create the "
                                       "group", op="init", group=group_name, rank=rank, timed_out=True)
            os.sched_yield()
        cores = int(np.unpackbits(np.bitwise_or.reduce(masks, axis=0)).sum())
        crowded = local.Get_size() > cores
    finally:
        local.Free()
    return 0 if crowded else SPIN


CPU_MASK_BYTES = 128
"""Cores an affinity mask covers in `spin_for` (1024, as glibc's cpu_set_t)."""
_STUCK: list[tuple[Any, ...]] = []
"""`spin_for`'s requests that timed out, with their buffers."""


def _module(x: Any) -> Any:
    """NumPy for host arrays, CuPy for device ones."""
    return np if isinstance(x, np.ndarray) else importlib.import_module("cupy")


class MpiBackend(PointToPoint, Backend):
    """Collectives and point-to-point ops over an MPI communicator of the group's members (mpi4py)."""

    name = "mpi"
    options_class = MpiOptions

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        super().__init__(store, rank, size, group_name, options)
        own: MpiOptions = self.own_options()
        self.check_calls = own.check_calls
        comm = group_comm(store, rank, size, group_name, options.timeout)
        self.ch = Channel(comm, rank, size, group_name, options.timeout, own.spin if own.spin is not None
                          else spin_for(comm, options.timeout, group_name, rank))
        self.MPI = self.ch.MPI
        self._device: bool | None = None
        self._call: tuple[int, int, int, int, int] | None = None
        """The call `_begin` checked last (made into the runner's `Check`)."""
        self._fresh: tuple[Signature, Callable[[Check | None], plans.Runner]] | None = None
        """The op run the full way last, as (signature, maker of its runner), until the group asks (`prepared`)."""

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return available()

    # -- the template: arguments, the call check, contiguous buffers

    def _array(self, x: Any, what: str) -> Any:
        if isinstance(x, np.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            if self._device is None:
                self._device = cuda_aware()
            if self._device:
                return x
            raise TypeError(f"{what} is a device array but this MPI library is not CUDA-aware; copy it to the host, "
                            "use backend='nccl', or build the MPI library with CUDA support")
        raise TypeError(f"{what} must be a NumPy array (or a device array with a CUDA-aware MPI) for the mpi backend, "
                        f"got {type(x).__name__}")

    def _begin(self, op: Op, x: Any, redop: ReduceOp | None = None, aux: int = 0, count: int | None = None) -> str:
        name = OP_NAMES[op]
        self.ch.enter(name)
        self._fresh = self._call = None
        if self.check_calls and self.size > 1:
            code = dtype_code(x.dtype) if x is not None else 0
            n = (x.size if x is not None else 0) if count is None else count
            self._call = (int(op), code, n, REDUCE_CODES[redop.value] if redop else 0, aux)
            self.ch.start_check(self._call)
        return name

    def _keep(self, key: Signature, x: Any, make: Callable[[Check | None], plans.Runner]) -> None:
        """Keep the runner of the op just run on `x` the full way (`make(its call check)`), if a runner takes it."""
        if isinstance(x, np.ndarray) and x.flags.c_contiguous:
            self._fresh = (key, make)

    def prepared(self, key: Signature) -> plans.Runner | None:
        """The runner of the collective of `key` just run the full way (`plans`), or None."""
        fresh, self._fresh = self._fresh, None
        if fresh is None or fresh[0] != key:
            return None
        call, self._call = self._call, None
        return fresh[1](Check(self.ch, call) if call is not None else None)

    @staticmethod
    def _moved(x: Any) -> np.dtype | None:
        """The dtype MPI moves `x`'s bytes as, where not its own (`wire_view`)."""
        dtype = wire_view(x).dtype
        return None if dtype == x.dtype else dtype

    def _root(self, root: int, what: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}={root!r} is not a rank of group '{self.group_name}' (0..{self.size - 1})")
        return int(root)

    def _run(self, name: str, start: Callable[[], Any], keep: Any, peer: int | None = None,
             status: Any = None) -> None:
        """Start one request and wait for it to the group's deadline; an MPI error raises `DistributedError`."""
        try:
            self.ch.check_first(name)  # before the op's requests: another call's could write past its buffers
            request = start()
            self.ch.wait([request], name, peer, keep, status)
        except self.MPI.Exception as e:
            raise self.ch.fail(name, peer, f"MPI error: {e.Get_error_string()}") from e

    @staticmethod
    def _contiguous(x: Any) -> Any:
        return x if x.flags.c_contiguous else _module(x).ascontiguousarray(x)

    @staticmethod
    def _back(x: Any, work: Any) -> None:
        if work is not x:
            x[...] = work

    def _wide(self, x: Any, op: ReduceOp) -> Any:
        """The float32 copy a reduction of a low-precision `x` runs on (MPI has no such dtype), or None."""
        wide = wide_dtype(x.dtype)
        if wide is not None:
            return _module(x).ascontiguousarray(x, dtype=wide)
        return None

    # -- collectives

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        x = self._array(x, "all_reduce input")
        op = check_reduce_op(op, x.dtype)
        name = self._begin(Op.ALL_REDUCE, x, op)
        wide = self._wide(x, op)
        work = wide if wide is not None else self._contiguous(x)
        buf = wire_view(work.reshape(-1))
        ufunc = UFUNCS[op]
        if plans.duo_reduces(self.ch, work.nbytes):
            if not isinstance(x, np.ndarray):
                ufunc = getattr(_module(x), ufunc.__name__)
            try:
                xp = _module(x)
                plans.duo_all_reduce(self.ch, self.ch.take(), ufunc, work.reshape(-1), xp.empty(work.size, work.dtype),
                                     True, xp.empty(work.size, work.dtype) if plans.duo_copies(work.nbytes) else None)
            except self.MPI.Exception as e:
                raise self.ch.fail(name, None, f"MPI error: {e.Get_error_string()}") from e
        else:
            self._run(name, lambda: self.ch.comm.Iallreduce(self.MPI.IN_PLACE, buf, reduce_op(op, work.dtype)), buf)
        if op is ReduceOp.AVG:
            finish_average(work, self.size)
        if wide is not None:
            narrow_into(x, wide)
            return
        self._back(x, work)
        mpi_op, average = reduce_op(op, work.dtype), op is ReduceOp.AVG
        self._keep(signature("all_reduce", x, op), x,
                   lambda checked: plans.all_reduce(self.ch, checked, mpi_op, self._moved(x), average, ufunc,
                                                    x.dtype, x.size))

    def broadcast(self, x: Array, src: int) -> None:
        x = self._array(x, "broadcast input")
        src = self._root(src, "src")
        name = self._begin(Op.BROADCAST, x, aux=src)
        work = self._contiguous(x)
        buf = wire_view(work.reshape(-1))
        try:
            if self.ch.duo:
                plans.duo_broadcast(self.ch, self.ch.take(), buf, src)
            else:
                self.ch.check_first(name)
                self.ch.wait([self.ch.comm.Ibcast(buf, src)], name, None, buf)
        except self.MPI.Exception as e:
            raise self.ch.fail(name, None, f"MPI error: {e.Get_error_string()}") from e
        self._back(x, work)
        self._keep(signature("broadcast", x, src), x,
                   lambda checked: plans.broadcast(self.ch, checked, src, self._moved(x)))

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        x = self._array(x, "reduce input")
        op = check_reduce_op(op, x.dtype)
        dst = self._root(dst, "dst")
        name = self._begin(Op.REDUCE, x, op, aux=dst)
        wide = self._wide(x, op)
        work = wide if wide is not None else self._contiguous(x)
        buf = wire_view(work.reshape(-1))
        mpi_op = reduce_op(op, work.dtype)
        if self.rank == dst:
            self._run(name, lambda: self.ch.comm.Ireduce(self.MPI.IN_PLACE, buf, mpi_op, dst), buf)
            if op is ReduceOp.AVG:
                finish_average(work, self.size)
            if wide is not None:
                narrow_into(x, wide)
            else:
                self._back(x, work)
        else:
            self._run(name, lambda: self.ch.comm.Ireduce(buf, None, mpi_op, dst), buf)

    def _out(self, out: Array | None, shape: tuple[int, ...], like: Any, op: str) -> Any:
        if isinstance(like, np.ndarray):
            return output_array(out, shape, like.dtype, op, "mpi")
        if out is None:
            return _module(like).empty(shape, like.dtype)
        if tuple(out.shape) != shape or out.dtype != like.dtype or not out.flags.c_contiguous:
            raise ValueError(f"{op} out= must be a C-contiguous {like.dtype} array of shape {shape}; "
                             f"got {out.dtype} {tuple(out.shape)}")
        return out

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        x = self._array(x, "all_gather input")
        out = self._out(out, (self.size, *x.shape), x, "all_gather")
        name = self._begin(Op.ALL_GATHER, x)
        send, recv = wire_view(self._contiguous(x).reshape(-1)), wire_view(out.reshape(-1))
        try:
            if self.ch.duo:
                plans.duo_all_gather(self.ch, self.ch.take(), send, recv)
            else:
                self.ch.check_first(name)
                self.ch.wait([self.ch.comm.Iallgather(send, recv)], name, None, (send, recv))
        except self.MPI.Exception as e:
            raise self.ch.fail(name, None, f"MPI error: {e.Get_error_string()}") from e
        self._keep(signature("all_gather", x, None), x, lambda checked: plans.all_gather(self.ch, checked,
                                                                                         self._moved(x)))
        return out

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        x = self._array(x, "reduce_scatter input")
        op = check_reduce_op(op, x.dtype)
        rows = scatter_rows(x, self.size, "reduce_scatter")
        out = self._out(out, (rows, *x.shape[1:]), x, "reduce_scatter")
        name = self._begin(Op.REDUCE_SCATTER, x, op)
        wide = self._wide(x, op)
        work = wide if wide is not None else self._contiguous(x)
        result = _module(x).empty(out.shape, work.dtype) if wide is not None else out
        mpi_op, ufunc = reduce_op(op, work.dtype), UFUNCS[op]
        if self.ch.duo:
            flat = work.reshape(-1)
            scratch = _module(x).empty(flat.size // 2, work.dtype)
            try:
                plans.duo_reduce_scatter(self.ch, self.ch.take(), wire_view(flat), wire_view(scratch))
            except self.MPI.Exception as e:
                raise self.ch.fail(name, None, f"MPI error: {e.Get_error_string()}") from e
            if not isinstance(x, np.ndarray):
                ufunc = getattr(_module(x), ufunc.__name__)
            plans.scatter_reduce(ufunc, self.rank, flat, scratch, result.reshape(-1))
        else:
            send, recv = wire_view(work.reshape(-1)), wire_view(result.reshape(-1))
            self._run(name, lambda: self.ch.comm.Ireduce_scatter_block(send, recv, mpi_op), (send, recv))
        if op is ReduceOp.AVG:
            finish_average(result, self.size)
        if wide is not None:
            narrow_into(out, result)
            return out
        average = op is ReduceOp.AVG
        self._keep(signature("reduce_scatter", x, op), x,
                   lambda checked: plans.reduce_scatter(self.ch, checked, mpi_op, self._moved(x), average, ufunc,
                                                        x.dtype, x.size))
        return out

    def gather(self, x: Array, dst: int) -> Array | None:
        x = self._array(x, "gather input")
        dst = self._root(dst, "dst")
        name = self._begin(Op.GATHER, x, aux=dst)
        send = wire_view(self._contiguous(x).reshape(-1))
        if self.rank != dst:
            self._run(name, lambda: self.ch.comm.Igather(send, None, dst), send)
            return None
        out = _module(x).empty((self.size, *x.shape), x.dtype)
        recv = wire_view(out.reshape(-1))
        self._run(name, lambda: self.ch.comm.Igather(send, recv, dst), (send, recv))
        return out

    def scatter(self, x: Array | None, src: int) -> Array:
        src = self._root(src, "src")
        header = np.zeros(2 + MAX_NDIM, np.int64)
        full = None
        if self.rank == src:
            full = self._array(x, "scatter input on the source rank")
            if full.ndim == 0 or full.shape[0] != self.size:
                raise ValueError(f"scatter needs an array of shape ({self.size}, ...) on the source rank, "
                                 f"got {full.shape}")
            if full.ndim - 1 > MAX_NDIM:
                raise ValueError(f"scatter takes arrays of at most {MAX_NDIM + 1} dimensions, got {full.ndim}")
            header[0], header[1] = dtype_code(full.dtype), full.ndim - 1
            header[2 : 1 + full.ndim] = full.shape[1:]
        name = self._begin(Op.SCATTER, None, aux=src)
        self._run(name, lambda: self.ch.comm.Ibcast(header, src), header, peer=src)
        dtype, shape = DTYPES[int(header[0]) - 1], tuple(int(v) for v in header[2 : 2 + int(header[1])])
        xp = _module(full) if full is not None else np
        out = xp.empty(shape, dtype)
        recv = wire_view(out.reshape(-1))
        send = wire_view(self._contiguous(full).reshape(-1)) if full is not None else None
        self._run(name, lambda: self.ch.comm.Iscatter(send, recv, src), (send, recv), peer=src)
        return out

    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        x = self._array(x, "all_to_all input")
        uneven = input_split_sizes is not None or output_split_sizes is not None
        if not uneven and (x.ndim == 0 or x.shape[0] % self.size):
            raise ValueError(f"all_to_all needs x.shape[0] divisible by the group size {self.size}; got {x.shape} "
                             "(or pass input_split_sizes)")
        ins, given = check_splits(x.shape, self.size, self.rank, input_split_sizes, output_split_sizes)
        send = wire_view(self._contiguous(x).reshape(-1))
        if not uneven:
            name = self._begin(Op.ALL_TO_ALL, x)
            out = _module(x).empty(x.shape, x.dtype)
            recv = wire_view(out.reshape(-1))
            self._run(name, lambda: self.ch.comm.Ialltoall(send, recv), (send, recv))
            return out
        name = self._begin(Op.ALL_TO_ALL, x, aux=UNEVEN_ALL_TO_ALL, count=0)
        row = int(np.prod(x.shape[1:]))
        said = announcement(ins, given, row)
        heard = np.empty_like(said)
        self._run(name, lambda: self.ch.comm.Ialltoall(said, heard), (said, heard))
        outs, problems = settle(self.rank, ins, given, row, heard)
        if problems:
            peer, why = problems[0]
            raise self.ch.fail(name, peer, why)
        out = _module(x).empty((sum(outs), *x.shape[1:]), x.dtype)
        recv = wire_view(out.reshape(-1))
        sends = [v * row for v in ins]
        recvs = [v * row for v in outs]
        spec_s = [send, (sends, offsets(sends)[:-1])]
        spec_r = [recv, (recvs, offsets(recvs)[:-1])]
        self._run(name, lambda: self.ch.comm.Ialltoallv(spec_s, spec_r), (send, recv))
        return out

    def barrier(self) -> None:
        name = self._begin(Op.BARRIER, None)
        if self.check_calls and self.size > 1:  # the call check meets every member: it is the barrier
            self.ch.wait([], name)
        else:
            self._run(name, lambda: self.ch.comm.Ibarrier(), None)
        self._fresh = (signature("barrier", None, None), lambda checked: plans.barrier(self.ch, checked))

    # -- the group's life

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        self.ch.explain_peer, self.ch.explain_peers = describe_peer, describe_peers

    def abort(self, reason: str) -> None:
        """Send `reason` to every peer (their waits raise it) and refuse later ops; a started collective cannot be
        cancelled in MPI, so peers blocked in one raise at their next poll, not at their deadline."""
        self.ch.abort(reason)

    def abort_failed(self, reason: str) -> None:
        self.ch.abort(reason, failed=True)

    def close(self) -> None:
        self.ch.close()


__all__ = ["INSTALL", "MpiBackend", "mpi"]
