"""The NCCL backend's ops: each a short function that stages its arrays and hands `enqueue` to the template.

`NcclBackend._launch` (in `backend.py`) orders the op after the caller's stream, runs `enqueue(stream)`
under the watchdog and returns an `NcclWork`; `finish` runs on the host after completion. Pure data
movement goes as the native NCCL type when there is one and as bytes otherwise; point-to-point
patterns (gather, scatter, all_to_all) are grouped send/recv.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from axond.distributed.backends.base import P2P, Array
from axond.distributed.backends.nccl.support import (
    META_SLOTS,
    P2P_HEADER_SLOTS,
    check_p2p_header,
    decode_meta,
    encode_meta,
    encode_p2p_header,
    transfer_type,
)
from axond.distributed.backends.nccl.plans import Planned, check_out
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.backends.splits import announcement, check_splits, offsets, settle

if TYPE_CHECKING:
    from axond.distributed.backends.nccl.backend import NcclBackend
    from axond.distributed.backends.nccl.work import NcclWork

_INT_MAX = 2**31 - 1
"""ncclBroadcast takes its count as a C int in CuPy; larger broadcasts go in chunks."""


def _average(b: NcclBackend, x: Any, stream: Any) -> None:
    """Finish AVG-as-SUM on the group's stream, like the tcp backend (integer AVG was refused before)."""
    with stream:
        b._cp.true_divide(x, b.size, out=x)


def _all_reduce_on(stream: Any, b: NcclBackend, s: Any, plan: Planned) -> None:
    ptr = s.buf.data.ptr
    if plan.count:
        b._comm.allReduce(ptr, ptr, plan.count, plan.nccl_type, plan.nccl_op, stream.ptr)
    if plan.divide_by_size:
        _average(b, s.buf, stream)
    b._copy_back(s, stream)


def all_reduce(b: NcclBackend, x: Array, op: ReduceOp) -> NcclWork:
    """In place: ncclAllReduce with sendbuff == recvbuff; AVG as SUM then a division on the stream."""
    s = b._stage(x, "all_reduce")
    plan = b.plans.reduction(s.buf.dtype, op, s.buf.size)
    return b._launch("all_reduce", None, _all_reduce_on, (b, s, plan), (s,), b._finish_of(s))


def _broadcast_on(stream: Any, b: NcclBackend, s: Any, plan: Planned, src: int) -> None:
    count = plan.count
    for start in range(0, count, _INT_MAX):
        ptr = s.buf.data.ptr + start * plan.element_bytes
        b._comm.broadcast(ptr, ptr, min(_INT_MAX, count - start), plan.nccl_type, src, stream.ptr)
    b._copy_back(s, stream)


def broadcast(b: NcclBackend, x: Array, src: int) -> NcclWork:
    """In place: ncclBroadcast from `src`, in chunks of at most INT_MAX elements."""
    b._check_peer(src, "src", "broadcast")
    s = b._stage(x, "broadcast")
    plan = b.plans.transfer(s.buf.dtype, s.buf.size)
    return b._launch("broadcast", src, _broadcast_on, (b, s, plan, src), (s,), b._finish_of(s))


def _reduce_on(stream: Any, b: NcclBackend, s: Any, plan: Planned, dst: int) -> None:
    ptr = s.buf.data.ptr
    if plan.count:
        b._comm.reduce(ptr, ptr, plan.count, plan.nccl_type, plan.nccl_op, dst, stream.ptr)
    if plan.divide_by_size and b.rank == dst:
        _average(b, s.buf, stream)
    b._copy_back(s, stream)


def reduce(b: NcclBackend, x: Array, dst: int, op: ReduceOp) -> NcclWork:
    """In place on `dst`: ncclReduce; the other ranks' arrays are left as they were."""
    b._check_peer(dst, "dst", "reduce")
    s = b._stage(x, "reduce")
    plan = b.plans.reduction(s.buf.dtype, op, s.buf.size)
    return b._launch("reduce", dst, _reduce_on, (b, s, plan, dst), (s,), b._finish_of(s))


def _out(b: NcclBackend, out: Array | None, shape: tuple[int, ...], dtype: Any, op: str) -> Any:
    """`out=` staged as the op's device buffer (None: the op allocates one), after checking its shape and dtype."""
    if out is None:
        return None
    check_out(tuple(out.shape), out.dtype, shape, dtype, op)
    return b._stage(out, f"{op} out")


def _into(b: NcclBackend, staged_out: Any, out: Array | None, dev: Any, host: bool) -> Any:
    """The op's result: `out` (copied back from the device buffer if it was staged), else the new array."""
    if staged_out is None:
        return b._result(dev, host)
    b._unstage(staged_out)
    return out


def _completion(b: NcclBackend, s: Any, o: Any, out: Array | None, dev: Any) -> tuple[Any, Any]:
    """(finish, value) of an op writing `dev`: a host finish where NumPy is involved, else the device result."""
    if s.host or (o is not None and o.host):
        return (lambda: _into(b, o, out, dev, s.host)), None
    return None, (out if o is not None else dev)


def _all_gather_on(stream: Any, b: NcclBackend, s: Any, dev: Any, o: Any, plan: Planned) -> None:
    if plan.count:
        b._comm.allGather(s.buf.data.ptr, dev.data.ptr, plan.count, plan.nccl_type, stream.ptr)
    if o is not None:
        b._copy_back(o, stream)


def all_gather(b: NcclBackend, x: Array, out: Array | None = None) -> NcclWork:
    """ncclAllGather into a new (size, *x.shape) array, or into `out` of that shape."""
    s = b._stage(x, "all_gather")
    plan = b.plans.transfer(s.buf.dtype, s.buf.size)
    o = _out(b, out, (b.size, *s.buf.shape), s.buf.dtype, "all_gather")
    with b._device:
        dev = o.buf if o is not None else b._cp.empty((b.size, *s.buf.shape), dtype=s.buf.dtype)
    finish, value = _completion(b, s, o, out, dev)
    return b._launch("all_gather", None, _all_gather_on, (b, s, dev, o, plan), (s, dev, o), finish, value)


def _reduce_scatter_on(stream: Any, b: NcclBackend, s: Any, dev: Any, o: Any, plan: Planned) -> None:
    if plan.count:
        b._comm.reduceScatter(s.buf.data.ptr, dev.data.ptr, plan.count, plan.nccl_type, plan.nccl_op, stream.ptr)
    if plan.divide_by_size:
        _average(b, dev, stream)
    if o is not None:
        b._copy_back(o, stream)


def reduce_scatter(b: NcclBackend, x: Array, op: ReduceOp, out: Array | None = None) -> NcclWork:
    """ncclReduceScatter: this rank's block of x.shape[0] // size rows (into `out` of that shape if given)."""
    s = b._stage(x, "reduce_scatter")
    rows = b._rows(s, "reduce_scatter") // b.size
    shape = (rows, *s.buf.shape[1:])
    plan = b.plans.reduction(s.buf.dtype, op, math.prod(shape))
    o = _out(b, out, shape, s.buf.dtype, "reduce_scatter")
    with b._device:
        dev = o.buf if o is not None else b._cp.empty(shape, dtype=s.buf.dtype)
    finish, value = _completion(b, s, o, out, dev)
    return b._launch("reduce_scatter", None, _reduce_scatter_on, (b, s, dev, o, plan), (s, dev, o), finish, value)


def _grouped(b: NcclBackend, calls: Callable[[], None]) -> None:
    """Run point-to-point calls inside ncclGroupStart/End so that they progress together."""
    b._nccl.groupStart()
    try:
        calls()
    finally:
        b._nccl.groupEnd()


def gather(b: NcclBackend, x: Array, dst: int) -> NcclWork:
    """Grouped recvs on `dst` (plus a local copy of its own block), a send everywhere else."""
    b._check_peer(dst, "dst", "gather")
    s = b._stage(x, "gather")
    ntype, factor = transfer_type(s.buf.dtype, b._version)
    count, nbytes, mine = s.buf.size * factor, s.buf.nbytes, b.rank == dst
    with b._device:
        out = b._cp.empty((b.size, *s.buf.shape), dtype=s.buf.dtype) if mine else None

    def calls(stream: Any) -> None:
        if not count:
            return
        if out is None:
            b._comm.send(s.buf.data.ptr, count, b._const(ntype), dst, stream.ptr)
            return
        for r in range(b.size):
            if r != dst:
                b._comm.recv(out.data.ptr + r * nbytes, count, b._const(ntype), r, stream.ptr)

    def enqueue(stream: Any) -> None:
        _grouped(b, lambda: calls(stream))
        if out is not None:
            b._copy(out.data.ptr + dst * nbytes, s.buf.data.ptr, nbytes, stream)

    if s.host and out is not None:
        return b._launch("gather", dst, enqueue, (), (s, out), lambda: b._result(out, True))
    return b._launch("gather", dst, enqueue, (), (s, out), None, out)


def scatter(b: NcclBackend, x: Array | None, src: int) -> NcclWork:
    """Broadcast the slice's shape and dtype first (the others pass None), then grouped sends from `src`."""
    b._check_peer(src, "src", "scatter")
    cp, mine = b._cp, b.rank == src
    if mine and x is None:
        raise ValueError(f"nccl scatter: the src rank {src} must pass the ({b.size}, ...) array, not None")
    s = b._stage(x, "scatter") if mine else None
    if s is not None and (s.buf.ndim == 0 or s.buf.shape[0] != b.size):
        raise ValueError(f"nccl scatter: src's array must have shape ({b.size}, ...), got {s.buf.shape}")
    with b._device:
        meta = cp.asarray(encode_meta(s.buf.shape[1:], s.buf.dtype)) if s is not None else cp.empty(
            META_SLOTS, dtype=np.int64)
    broadcast(b, meta, src).synchronize()  # the host reads the header
    shape, dtype = decode_meta(meta.get())
    ntype, factor = transfer_type(dtype, b._version)
    with b._device:
        out = cp.empty(shape, dtype=dtype)
    count, nbytes = out.size * factor, out.nbytes

    def calls(stream: Any) -> None:
        if not count:
            return
        if s is None:
            b._comm.recv(out.data.ptr, count, b._const(ntype), src, stream.ptr)
            return
        for r in range(b.size):
            if r != src:
                b._comm.send(s.buf.data.ptr + r * nbytes, count, b._const(ntype), r, stream.ptr)

    def enqueue(stream: Any) -> None:
        _grouped(b, lambda: calls(stream))
        if s is not None:
            b._copy(out.data.ptr, s.buf.data.ptr + src * nbytes, nbytes, stream)

    if s is not None and s.host:
        return b._launch("scatter", src, enqueue, (), (s, out), lambda: b._result(out, True))
    return b._launch("scatter", src, enqueue, (), (s, out), None, out)


def all_to_all(b: NcclBackend, x: Array, input_split_sizes: Sequence[int] | None = None,
               output_split_sizes: Sequence[int] | None = None) -> NcclWork:
    """Grouped send/recv with every peer; the own block is a device copy. With split sizes, an even all_to_all
    of the element counts both ways comes first (NCCL frames carry no sizes): it gives the output sizes when
    they were not passed, and a disagreement raises on both ranks of the pair instead of hanging NCCL."""
    s = b._stage(x, "all_to_all")
    if input_split_sizes is None and output_split_sizes is None:
        b._rows(s, "all_to_all")
        ins = outs = [s.buf.shape[0] // b.size] * b.size
    else:
        ins, given = check_splits(s.buf.shape, b.size, b.rank, input_split_sizes, output_split_sizes)
        row_elems = math.prod(s.buf.shape[1:])
        counts = all_to_all(b, announcement(ins, given, row_elems))
        outs, problems = settle(b.rank, ins, given, row_elems, counts.result())  # NumPy in, NumPy out
        if problems:  # abort, as the tcp backend does: the other members' data all_to_all fails instead of waiting
            counts._watched.peer, why = problems[0]
            b._watchdog.fail(counts._watched, why)
            raise b._watchdog.wait_failure("all_to_all")
    ntype, factor = transfer_type(s.buf.dtype, b._version)
    with b._device:
        out = b._cp.empty((sum(outs), *s.buf.shape[1:]), s.buf.dtype)
    row = math.prod(s.buf.shape[1:]) * s.buf.dtype.itemsize
    src_at, dst_at = offsets(ins), offsets(outs)
    per_elem = s.buf.dtype.itemsize // factor

    def calls(stream: Any) -> None:
        for r in range(b.size):
            if r != b.rank and ins[r]:
                b._comm.send(s.buf.data.ptr + src_at[r] * row, ins[r] * row // per_elem, b._const(ntype), r, stream.ptr)
            if r != b.rank and outs[r]:
                b._comm.recv(out.data.ptr + dst_at[r] * row, outs[r] * row // per_elem, b._const(ntype), r, stream.ptr)

    def enqueue(stream: Any) -> None:
        _grouped(b, lambda: calls(stream))
        b._copy(out.data.ptr + dst_at[b.rank] * row, s.buf.data.ptr + src_at[b.rank] * row, ins[b.rank] * row, stream)

    if s.host:
        return b._launch("all_to_all", None, enqueue, (), (s, out), lambda: b._result(out, True))
    return b._launch("all_to_all", None, enqueue, (), (s, out), None, out)


def send(b: NcclBackend, x: Array, dst: int, tag: int) -> NcclWork:
    """A 4-int64 header (tag, bytes, dtype) then the payload, grouped so they go out together."""
    b._check_peer(dst, "dst", "send")
    if dst == b.rank:
        raise ValueError(f"nccl send: rank {b.rank} cannot send to itself")
    s = b._stage(x, "send")
    ntype, factor = transfer_type(s.buf.dtype, b._version)
    with b._device:
        header = b._cp.asarray(encode_p2p_header(tag, s.buf.nbytes, s.buf.dtype))

    def calls(stream: Any) -> None:
        b._comm.send(header.data.ptr, P2P_HEADER_SLOTS, b._const("NCCL_INT64"), dst, stream.ptr)
        if s.buf.size:
            b._comm.send(s.buf.data.ptr, s.buf.size * factor, b._const(ntype), dst, stream.ptr)

    return b._launch("send", dst, lambda stream: _grouped(b, lambda: calls(stream)), (), (s, header))


def recv(b: NcclBackend, x: Array, src: int, tag: int) -> NcclWork:
    """Receive the header first and check it, so a mismatched send fails cleanly instead of hanging."""
    b._check_peer(src, "src", "recv")
    if src == b.rank:
        raise ValueError(f"nccl recv: rank {b.rank} cannot receive from itself")
    s = b._stage(x, "recv")
    ntype, factor = transfer_type(s.buf.dtype, b._version)
    with b._device:
        header = b._cp.empty(P2P_HEADER_SLOTS, dtype=np.int64)

    def enqueue_header(stream: Any) -> None:
        b._comm.recv(header.data.ptr, P2P_HEADER_SLOTS, b._const("NCCL_INT64"), src, stream.ptr)

    first = b._launch("recv", src, enqueue_header, (), (s, header))
    first.synchronize()  # the host reads the header
    problem = check_p2p_header(header.get(), tag, s.buf.nbytes, s.buf.dtype)
    if problem is not None:
        b._watchdog.fail(first._watched, f"mismatched send: {problem}")
        raise b._watchdog.wait_failure("recv")

    def enqueue(stream: Any) -> None:
        if s.buf.size:
            b._comm.recv(s.buf.data.ptr, s.buf.size * factor, b._const(ntype), src, stream.ptr)
        b._copy_back(s, stream)

    return b._launch("recv", src, enqueue, (), (s,), b._finish_of(s))


def batch_p2p(b: NcclBackend, batch: list[P2P]) -> NcclWork:
    """Every ("isend" | "irecv", array, peer, tag) of a batch_isend_irecv in one NCCL group, so that no order of
    them deadlocks. Each send carries its usual header; the receives' headers are checked once all completed."""
    header_type = b._const("NCCL_INT64")
    parts = []
    for kind, x, peer, tag in batch:
        b._check_peer(peer, "peer", kind)
        s = b._stage(x, kind)
        ntype, factor = transfer_type(s.buf.dtype, b._version)
        with b._device:
            header = (b._cp.asarray(encode_p2p_header(tag, s.buf.nbytes, s.buf.dtype)) if kind == "isend"
                      else b._cp.empty(P2P_HEADER_SLOTS, dtype=np.int64))
        parts.append((kind, s, peer, tag, header, b._const(ntype), s.buf.size * factor))

    def calls(stream: Any) -> None:
        for kind, s, peer, _, header, ntype, count in parts:
            move = b._comm.send if kind == "isend" else b._comm.recv
            move(header.data.ptr, P2P_HEADER_SLOTS, header_type, peer, stream.ptr)
            if count:
                move(s.buf.data.ptr, count, ntype, peer, stream.ptr)

    launched: list[NcclWork] = []

    def finish() -> None:
        for kind, s, peer, tag, header, _, _ in parts:
            if kind == "irecv":
                problem = check_p2p_header(header.get(), tag, s.buf.nbytes, s.buf.dtype)
                if problem is not None:  # abort, as a mismatched recv does
                    watched = launched[0]._watched
                    watched.peer = peer
                    b._watchdog.fail(watched, f"the irecv from peer {peer}: mismatched send: {problem}")
                    raise b._watchdog.wait_failure("batch_isend_irecv")
                b._unstage(s)

    keep = tuple(x for part in parts for x in (part[1], part[4]))
    launched.append(b._launch("batch_isend_irecv", None, lambda stream: _grouped(b, lambda: calls(stream)), (), keep,
                              finish))
    return launched[0]


def barrier(b: NcclBackend) -> NcclWork:
    """A one-element all_reduce, waited for on the host."""
    buf = b._barrier_buf

    def enqueue(stream: Any) -> None:
        b._comm.allReduce(buf.data.ptr, buf.data.ptr, 1, b._const("NCCL_INT32"), b._const("NCCL_SUM"), stream.ptr)

    return b._launch("barrier", None, enqueue, (), (buf,))


LAUNCHES: dict[str, Callable[..., NcclWork]] = {
    "all_reduce": all_reduce, "broadcast": broadcast, "reduce": reduce, "all_gather": all_gather,
    "reduce_scatter": reduce_scatter, "gather": gather, "scatter": scatter, "all_to_all": all_to_all,
    "send": send, "isend": send, "recv": recv, "batch_p2p": batch_p2p, "barrier": barrier,
}
"""Each op of `axond.distributed.backends.base.op_methods` by name, as the function that launches it
(`NcclBackend.start`)."""
