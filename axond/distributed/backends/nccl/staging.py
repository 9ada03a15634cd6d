"""The staging path: CuPy arrays through the tcp backend when NCCL cannot run (ranks sharing a GPU, NCCL missing,
CPU and GPU ranks in one group), as gloo moves CUDA tensors.

Each op copies its device arrays into reusable host buffers (pinned where CuPy can pin them) on the caller's
current stream, runs the tcp backend's op on them (shared memory between ranks of one host, sockets between
hosts), and copies the results back to the device on the same stream. The host waits for the copy out (tcp
needs the bytes); the copy back is queued, and its buffer is reused only once that copy completed. NumPy arrays
go to the tcp backend as they are. Its wire format is the tcp backend's, so a CPU-only member running plain tcp
takes part in the same group. CuPy is imported only when a device array arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.backends.base import P2P, Array, Backend, BackendOptions
from axond.distributed.backends.registry import backend_class
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.store import Store

MIN_CLASS = 4096


def size_class(nbytes: int) -> int:
    """The buffer size that holds `nbytes`: the next power of two, at least `MIN_CLASS`."""
    return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


class HostBuffers:
    """Host buffers by size class, reused once the device copy that last read each one has completed.

    `alloc(nbytes)` makes a uint8 array (pinned memory on a GPU machine); a buffer handed back with an event
    (anything with `synchronize()`) is not handed out again before that event completed. At most `keep_bytes`
    of idle buffers are kept.
    """

    def __init__(self, alloc: Callable[[int], np.ndarray], keep_bytes: int = 1 << 30) -> None:
        self._alloc = alloc
        self._keep = keep_bytes
        self._idle: dict[int, list[tuple[np.ndarray, Any]]] = {}
        self.idle_bytes = 0
        self.made = 0

    def get(self, nbytes: int) -> np.ndarray:
        size = size_class(nbytes)
        idle = self._idle.get(size)
        if idle:
            buf, event = idle.pop()
            self.idle_bytes -= size
            if event is not None:
                event.synchronize()
            return buf
        self.made += 1
        return self._alloc(size)

    def put(self, buf: np.ndarray, event: Any = None) -> None:
        size = int(buf.nbytes)
        if self.idle_bytes + size <= self._keep:
            self._idle.setdefault(size, []).append((buf, event))
            self.idle_bytes += size


def host_view(buf: np.ndarray, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """The first bytes of `buf` as a C-contiguous array of `shape` and `dtype`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return buf[:nbytes].view(dtype).reshape(shape)


class StagedWork:
    """An op of the staging path, already run on the host; `event` (None for NumPy-only ops) follows its copies
    back to the device on the caller's stream. Same surface as `NcclWork`."""

    def __init__(self, op: str, group: str, value: Any, event: Any) -> None:
        self.op, self.group = op, group
        self._value = value
        self.event = event

    def is_completed(self) -> bool:
        return self.event is None or bool(self.event.done)

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> BaseException | None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Order the caller's current stream after the copies back (the host does not wait)."""
        if self.event is not None:
            import cupy

            cupy.cuda.get_current_stream().wait_event(self.event)
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return True

    def result(self) -> Any:
        self.wait()
        return self._value


_START = {"isend": "send", "irecv": "recv"}


class StagingBackend(Backend):
    """CuPy (and NumPy) arrays through the tcp backend, staged through reusable pinned host buffers."""

    name = "staging"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Where CuPy is installed (device arrays can arrive); NumPy-only groups use the tcp backend itself."""
        import importlib.util

        if importlib.util.find_spec("cupy") is None:
            return False, "CuPy is not installed: pip install 'axond[gpu]'"
        return True, ""

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions,
                 reason: str = "", device: int | None = None) -> None:
        """`device`: the GPU this member uses, made the thread's current CuPy device (as the nccl backend does)."""
        super().__init__(store, rank, size, group_name, options)
        self.reason = reason
        """Why this group stages instead of running NCCL (from `placement.choose_path`)."""
        self._tcp = backend_class("tcp")(store, rank, size, group_name, options)
        self._cp: Any = None
        if device is not None:
            import cupy

            self._cp = cupy
            cupy.cuda.Device(device).use()
        self._buffers = HostBuffers(self._pinned)
        self._back: list[tuple[np.ndarray, Any, Any]] = []
        """(host buffer, host view, device array) to copy back after the current op."""

    def _pinned(self, nbytes: int) -> np.ndarray:
        mem = self._cp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def _is_device(self, x: Any) -> bool:
        if isinstance(x, np.ndarray) or x is None:
            return False
        if self._cp is None:
            try:
                import cupy
            except ImportError:
                return False
            self._cp = cupy
        return isinstance(x, self._cp.ndarray)

    def _host(self, x: Any, read: bool = True) -> Any:
        """`x` on the host: NumPy as it is, a CuPy array copied (if `read`) into a reused host buffer."""
        if not self._is_device(x):
            return x
        buf = self._buffers.get(x.nbytes)
        view = host_view(buf, tuple(x.shape), x.dtype)
        if read and x.size:
            self._cp.ascontiguousarray(x).get(out=view)  # on the current stream; the host waits for the bytes
        self._back.append((buf, view, None))
        return view

    def _written(self, view: np.ndarray, x: Any) -> None:
        """Mark staged `view` to be copied back into device array `x` when the op ends."""
        for i, (buf, v, _) in enumerate(self._back):
            if v is view:
                self._back[i] = (buf, v, x)

    def _device(self, value: Any) -> Any:
        """A result the tcp backend returned, on the device."""
        return None if value is None else self._cp.asarray(value)

    def _end(self) -> Any:
        """Queue the copies back on the current stream, hand the buffers back after them; the event (or None)."""
        back, self._back = self._back, []
        if not back:
            return None
        cp = self._cp
        for _, view, x in back:
            if x is None or not x.size:
                continue
            if x.flags.c_contiguous:
                x.set(view)
            else:
                x[...] = cp.asarray(view)
        event = cp.cuda.Event(disable_timing=True)
        event.record(cp.cuda.get_current_stream())
        for buf, _, _ in back:
            self._buffers.put(buf, event)
        return event

    def _run(self, call: Callable[[], Any]) -> Any:
        """Run one staged op: on failure its buffers go back unused and nothing is copied to the device."""
        try:
            return call()
        except BaseException:
            back, self._back = self._back, []
            for buf, _, _ in back:
                self._buffers.put(buf)
            raise

    def _in_place(self, x: Any, op: Callable[[Any], None], read: bool = True, write: bool = True) -> None:
        def call() -> None:
            h = self._host(x, read)
            op(h)
            if write:
                self._written(h, x)
            self._end()
        self._run(call)

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        self._in_place(x, lambda h: self._tcp.all_reduce(h, op))

    def broadcast(self, x: Array, src: int) -> None:
        self._in_place(x, lambda h: self._tcp.broadcast(h, src), read=self.rank == src)

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        self._in_place(x, lambda h: self._tcp.reduce(h, dst, op), write=self.rank == dst)

    def send(self, x: Array, dst: int, tag: int) -> None:
        self._in_place(x, lambda h: self._tcp.send(h, dst, tag), write=False)

    def recv(self, x: Array, src: int, tag: int) -> None:
        self._in_place(x, lambda h: self._tcp.recv(h, src, tag), read=False)

    def _gathered(self, call: Callable[[Any, Any], Any], x: Any, out: Any = None) -> Any:
        """An op returning an array: `out` filled in place, else the tcp result (on the device for device input)."""
        def run() -> Any:
            on_device = self._gpu_results(x)
            h, ho = self._host(x), self._host(out, read=False)
            value = call(h, ho)
            if out is not None:
                self._written(ho, out)
            self._end()
            if out is not None:
                return out
            return self._cp.asarray(value) if on_device and value is not None else value
        return self._run(run)

    def _gpu_results(self, x: Any) -> bool:
        """Whether an op whose input is `x` returns device arrays: a CuPy input, or None (scatter's other ranks)
        on a rank with CuPy (a GPU rank: NCCL would return a device array too)."""
        if x is not None:
            return self._is_device(x)
        if self._cp is None:
            try:
                import cupy
            except ImportError:
                return False
            self._cp = cupy
        return True

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        return self._gathered(lambda h, o: self._tcp.all_gather(h, o), x, out)

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        return self._gathered(lambda h, o: self._tcp.reduce_scatter(h, op, o), x, out)

    def gather(self, x: Array, dst: int) -> Array | None:
        return self._gathered(lambda h, _: self._tcp.gather(h, dst), x)

    def scatter(self, x: Array | None, src: int) -> Array:
        return self._gathered(lambda h, _: self._tcp.scatter(h, src), x)

    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        return self._gathered(lambda h, _: self._tcp.all_to_all(h, input_split_sizes, output_split_sizes), x)

    def batch_p2p(self, batch: list[P2P]) -> None:
        def call() -> None:
            staged = [(kind, self._host(x, read=kind == "isend"), x, peer, tag) for kind, x, peer, tag in batch]
            self._tcp.batch_p2p([(kind, h, peer, tag) for kind, h, _, peer, tag in staged])
            for kind, h, x, _, _ in staged:
                if kind == "irecv":
                    self._written(h, x)
            self._end()
        self._run(call)

    def barrier(self) -> None:
        self._tcp.barrier()

    def start(self, op: str, *args: Any, **kwargs: Any) -> StagedWork:
        """Run op `op` now (the host takes part in every staged op) and return its work, ordered like NCCL's."""
        method = getattr(self, _START.get(op, op))
        value = method(*args, **kwargs)
        event = None
        if self._cp is not None:
            event = self._cp.cuda.Event(disable_timing=True)
            event.record(self._cp.cuda.get_current_stream())
        return StagedWork(op, self.group_name, value, event)

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        self._tcp.explain_timeouts(describe_peer, describe_peers)

    def abort(self, reason: str) -> None:
        self._tcp.abort(reason)

    def abort_failed(self, reason: str) -> None:
        self._tcp.abort_failed(reason)

    def close(self) -> None:
        self._tcp.close()


BACKEND = StagingBackend
