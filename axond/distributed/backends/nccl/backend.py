"""The GPU data plane: collectives on CuPy arrays through NCCL (`cupy.cuda.nccl`).

CuPy is imported only when the backend is probed or built, never when axond is imported. Each group
owns one communicator, one CUDA stream and one watchdog; every op is a short `enqueue(stream)`
function run by the `_launch` template, which orders it after the caller's current stream, records
a completion event and returns an `NcclWork`. Written against CuPy's documented NCCL API; it runs
only where a GPU is present.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from axond.distributed.backends.base import P2P, Array, Backend, BackendOptions
from axond.distributed.backends.nccl import ops
from axond.distributed.backends.nccl.plans import PlanCache, Pool, check_peer, split_rows
from axond.distributed.backends.nccl.support import (
    NCCL_P2P_MIN_VERSION,
    choose_device,
    exchange_unique_id,
    preload_nccl_wheel,
    communicator_id_forms,
    unique_id_to_bytes,
)
from axond.distributed.backends.nccl.watchdog import Watchdog, WatchedOp
from axond.distributed.backends.nccl.work import NcclWork
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import BackendUnavailable, DistributedError, StoreTimeout
from axond.store import Store


@dataclass
class _Staged:
    """A caller's array as a C-contiguous CuPy buffer on the group's device."""

    buf: Any
    original: Any
    copy_back: bool
    host: bool


class NcclBackend(Backend):
    """Communicator of one process group on NCCL; arrays are CuPy (NumPy arrays are staged through the GPU)."""

    name = "nccl"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Probe CuPy, a CUDA device and NCCL without raising; the reason names what to install."""
        try:
            import cupy
        except ImportError:
            return False, "CuPy is not installed: pip install 'axond[gpu]'"
        except Exception as e:  # noqa: BLE001 - any failure to load means unavailable, said with its cause
            return False, f"CuPy failed to import ({type(e).__name__}: {e}); reinstall cupy-cuda12x"
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:  # noqa: BLE001 - any failure to load means unavailable, said with its cause
            return False, f"no CUDA device visible (CUDA says {type(e).__name__}: {e}); check the driver"
        if count < 1:
            return False, "no CUDA device visible (check the driver and CUDA_VISIBLE_DEVICES)"
        preload_nccl_wheel()
        try:
            from cupy.cuda import nccl
        except Exception as e:  # noqa: BLE001 - any failure to load means unavailable, said with its cause
            return False, f"CuPy has no NCCL (cupy.cuda.nccl: {e}): install the nvidia-nccl-cu12 wheel"
        if not getattr(nccl, "available", False):
            return False, "CuPy has no NCCL (cupy.cuda.nccl unavailable): install the nvidia-nccl-cu12 wheel"
        try:
            version = int(nccl.get_version())
        except Exception as e:  # noqa: BLE001 - any failure to load means unavailable, said with its cause
            return False, f"the NCCL library does not load ({type(e).__name__}: {e}): install nvidia-nccl-cu12"
        if version < NCCL_P2P_MIN_VERSION:
            return False, f"NCCL {version} is too old: axond needs NCCL >= 2.7 (pip install -U nvidia-nccl-cu12)"
        return True, ""

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        """Pick the device, exchange the unique ID through `store`, and build the communicator.

        The device becomes this thread's current CuPy device (like torch.cuda.set_device), so arrays
        the rank creates afterwards live on its GPU. The ID key carries an incarnation number (how
        often this rank built this group in this generation), so re-creating a group never picks up
        a stale ID.
        """
        super().__init__(store, rank, size, group_name, options)
        ok, why = self.is_available()
        if not ok:
            raise BackendUnavailable(f"backend 'nccl' cannot run here: {why}")
        import cupy
        from cupy.cuda import nccl

        self._cp: Any = cupy
        self._nccl: Any = nccl
        self._version = int(nccl.get_version())
        local_rank = options.runtime_env().local_rank
        index = choose_device(options.device, None if local_rank is None else str(local_rank),
                              cupy.cuda.runtime.getDeviceCount())
        self._device: Any = cupy.cuda.Device(index)
        self._device.use()
        self._lock = threading.Lock()
        self._closed = False
        with self._device:
            self._stream: Any = cupy.cuda.Stream(non_blocking=True)
            self._barrier_buf: Any = cupy.zeros(1, dtype=np.int32)
            incarnation = store.add(f"nccl/incarnation/{rank}", 1)
            unique_id = exchange_unique_id(
                store, rank, lambda: unique_id_to_bytes(nccl.get_unique_id()), options.timeout,
                group_name=group_name, key=f"nccl/{incarnation}/unique_id",
            )
            try:
                store.barrier(f"nccl/{incarnation}/init", size, options.timeout)
            except StoreTimeout as e:
                raise DistributedError(
                    f"nccl init: group {group_name!r} rank {rank}: not every one of the {size} ranks arrived "
                    f"within {options.timeout:.1f}s; each member must create the group",
                    op="nccl_init", group=group_name, rank=rank,
                ) from e
            self._comm: Any = self._communicator(unique_id)
        self._timeout = options.timeout
        self._events: Pool[Any] = Pool(lambda: cupy.cuda.Event(disable_timing=True))
        self.plans = PlanCache(self._const, self._version)
        self._watchdog = Watchdog(group=group_name, rank=rank, abort=self._comm.abort, async_error=self._async_error,
                                  on_done=self._released)

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        """A timed-out op's error says what its peer (send/recv) or the other members (collectives) are doing."""
        def explain(op: WatchedOp) -> str:
            if op.peer is not None and op.op in ("send", "recv"):
                return describe_peer(op.peer)
            return describe_peers(op.op) if describe_peers is not None else "no peer reports"
        self._watchdog.explain = explain

    def _communicator(self, unique_id: bytes) -> Any:
        """ncclCommInitRank, passing the unique id in whichever form this CuPy takes (`communicator_id_forms`)."""
        for comm_id in communicator_id_forms(unique_id):
            try:
                return self._nccl.NcclCommunicator(self.size, comm_id, self.rank)
            except (TypeError, OverflowError):
                continue
            except self._nccl.NcclError as e:
                raise DistributedError(
                    f"nccl init: group {self.group_name!r} rank {self.rank} on cuda:{self._device.id}: {e}; "
                    "NCCL refuses two ranks of one group on the same GPU (check LOCAL_RANK and CUDA_VISIBLE_DEVICES)",
                    op="nccl_init", group=self.group_name, rank=self.rank,
                ) from e
        raise DistributedError(f"nccl init: group {self.group_name!r}: this CuPy's NcclCommunicator takes the "
                               "unique id neither as bytes nor as a tuple of C chars; use CuPy 13 or 14",
                               op="nccl_init", group=self.group_name, rank=self.rank)

    def _async_error(self) -> str | None:
        try:
            self._comm.check_async_error()
        except self._nccl.NcclError as e:
            return str(e)
        return None

    def _stage(self, x: Array, op: str) -> _Staged:
        cp = self._cp
        if isinstance(x, np.ndarray):
            with self._device:
                return _Staged(cp.asarray(x if x.flags.c_contiguous else x.copy(order="C")), x, True, True)
        if isinstance(x, cp.ndarray):
            if x.device.id != self._device.id:
                raise ValueError(
                    f"nccl {op}: the array is on cuda:{x.device.id} but group {self.group_name!r} rank {self.rank} "
                    f"communicates on cuda:{self._device.id}; move it with `with cupy.cuda.Device({self._device.id}):`"
                )
            if x.flags.c_contiguous:
                return _Staged(x, x, False, False)
            with self._device:
                return _Staged(cp.ascontiguousarray(x), x, True, False)
        raise TypeError(f"nccl {op}: expected a CuPy (or NumPy) array, got {type(x).__name__}")

    def _unstage(self, staged: _Staged) -> None:
        if not staged.copy_back:
            return
        if staged.host and staged.original.flags.c_contiguous:
            staged.buf.get(out=staged.original)
        elif staged.host:
            staged.original[...] = staged.buf.get()
        else:
            staged.original[...] = staged.buf

    def _result(self, out: Any, host: bool) -> Any:
        return out.get() if host else out

    def _const(self, name: str) -> int:
        value: int = getattr(self._nccl, name)
        return value

    def _check_peer(self, peer: int, what: str, op: str) -> None:
        check_peer(peer, self.size, self.group_name, what, op)

    def _rows(self, staged: _Staged, op: str) -> int:
        return split_rows(tuple(staged.buf.shape), self.size, op)

    def _launch(
        self,
        op: str,
        peer: int | None,
        enqueue: Callable[..., None],
        args: tuple[Any, ...],
        keep: tuple[Any, ...],
        finish: Callable[[], Any] | None = None,
        value: Any = None,
    ) -> NcclWork:
        """The template of every op: order after the current stream, `enqueue(stream, *args)`, record completion.

        Two pooled CUDA events per op: `ready` (recorded on the caller's stream, back in the pool as soon as the
        group's stream waits on it) and the completion event (back in the pool once the op is seen complete).
        `finish` runs on the host after completion (NumPy results); `value` is a device result, ready on any
        stream ordered after the op.
        """
        if self._closed:
            raise DistributedError(f"nccl {op}: group {self.group_name!r} is closed", op=op,
                                   group=self.group_name, rank=self.rank)
        events = self._events
        if not len(events):
            self._watchdog.reap()
        with self._device, self._lock:
            ready = events.get()
            ready.record(self._cp.cuda.get_current_stream())
            stream = self._stream
            stream.wait_event(ready)
            events.put(ready)  # cudaStreamWaitEvent took the event's state: re-recording it is safe
            watched = WatchedOp(op, peer, time.monotonic() + self._timeout, None, keep, event=events.get())
            self._watchdog.watch(watched)
            try:
                enqueue(stream, *args)
            except BaseException as e:
                self._watchdog.finished(watched, completed=False)
                if not watched.aborted:
                    events.put(watched.event)  # never recorded: reusable at once
                if watched.aborted:
                    try:
                        self._watchdog.wait(watched)
                    except DistributedError as failure:
                        raise failure from e
                if isinstance(e, (self._nccl.NcclError, self._cp.cuda.runtime.CUDARuntimeError)):
                    raise DistributedError(f"nccl {op}: group {self.group_name!r} rank {self.rank}: {e}",
                                           op=op, group=self.group_name, rank=self.rank, peer=peer) from e
                raise
            watched.event.record(stream)
            watched.recorded = True
        return NcclWork(self, watched, finish, value)

    def _released(self, op: WatchedOp) -> None:
        """The watchdog saw `op` complete: its completion event goes back to the pool."""
        if op.event is not None:
            self._events.put(op.event)

    def _order_current_stream(self, event: Any) -> None:
        """Make the caller's current CuPy stream wait (on the device) for `event`; the host does not wait."""
        with self._device:
            self._cp.cuda.get_current_stream().wait_event(event)

    def _copy_back(self, staged: _Staged, stream: Any) -> None:
        """Copy a device stand-in into the caller's non-contiguous array, on `stream` after the op."""
        if staged.copy_back and not staged.host:
            with stream:
                staged.original[...] = staged.buf

    def _finish_of(self, staged: _Staged) -> Callable[[], Any] | None:
        """The host-side finish of an in-place op on `staged`: a copy into a NumPy array, else none."""
        return (lambda: self._unstage(staged)) if staged.host else None

    def _copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Device-to-device copy on `stream` (this rank's own block in gather, scatter, all_to_all)."""
        if nbytes:
            runtime = self._cp.cuda.runtime
            runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream.ptr)

    def start(self, op: str, *args: Any, **kwargs: Any) -> NcclWork:
        """Launch op `op` (a key of `op_methods`) without waiting; `NcclWork.result()` returns what its method would."""
        launch = ops.LAUNCHES.get(op)
        if launch is None:
            raise ValueError(f"nccl: unknown op {op!r}; choose one of {sorted(ops.LAUNCHES)}")
        return launch(self, *args, **kwargs)

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        ops.all_reduce(self, x, op).wait()

    def broadcast(self, x: Array, src: int) -> None:
        ops.broadcast(self, x, src).wait()

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        ops.reduce(self, x, dst, op).wait()

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        return ops.all_gather(self, x, out).result()

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        return ops.reduce_scatter(self, x, op, out).result()

    def gather(self, x: Array, dst: int) -> Array | None:
        return ops.gather(self, x, dst).result()

    def scatter(self, x: Array | None, src: int) -> Array:
        return ops.scatter(self, x, src).result()

    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        return ops.all_to_all(self, x, input_split_sizes, output_split_sizes).result()

    def send(self, x: Array, dst: int, tag: int) -> None:
        ops.send(self, x, dst, tag).wait()

    def recv(self, x: Array, src: int, tag: int) -> None:
        ops.recv(self, x, src, tag).wait()

    def barrier(self) -> None:
        """Blocks the host until every member reached it (as torch's NCCL barrier does)."""
        ops.barrier(self).synchronize()

    def batch_p2p(self, batch: list[P2P]) -> None:
        """The whole batch in one NCCL group, waited for (`ProcessGroup` starts it async through `start`)."""
        ops.batch_p2p(self, batch).wait()

    def abort(self, reason: str) -> None:
        """ncclCommAbort at once, without draining: peers blocked on this rank get NCCL's remote error, or
        their own watchdog fires after the group's timeout. (NCCL carries no message, so `reason` stays local.)"""
        if self._closed:
            return
        self._closed = True
        self._watchdog.close()
        self._comm.abort()

    def close(self) -> None:
        """Drain the stream (bounded by the timeout), then destroy the communicator; abort it if it hangs."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.close()
        if self._watchdog.failure is not None:
            return
        with self._device:
            drained = self._stream.record()
            deadline = time.monotonic() + self.options.timeout
            while not drained.done and time.monotonic() < deadline:
                time.sleep(1e-3)
            if drained.done:
                self._comm.destroy()
            else:
                self._comm.abort()
