"""`CudaCopies`: FSDP offload's copies for CuPy models, on a dedicated stream between pinned host and device memory.

Every copy is ordered after the work the compute (current) stream has issued so far: the copy stream waits on
an event recorded there. A device buffer the compute stream allocated may reuse memory its earlier kernels
still read, and the wait keeps the copy off it. FSDP starts the next unit's upload before this unit's compute
is issued, so the copy runs beside that compute. Each copy records a completion event. The compute stream
waits on it before the gather (`wait_compute`), the host only when it reads a downloaded gradient or writes
the host shard (`wait_host`). Host buffers are pinned (`cupyx.empty_pinned`), so the copies are real DMA
transfers that do not block the host. CuPy is imported when the first copier is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from axond.nn.device import Array, import_cupy, is_cupy_array


class CudaTransfer:
    """A copy on the copy stream: events at its start and end (timed, for the overlap check)."""

    def __init__(self, cupy: Any, start: Any, end: Any, keep: tuple[Array, Array]) -> None:
        self._cp = cupy
        self.start_event = start
        self.end_event = end
        self._keep: tuple[Array, Array] | None = keep
        """Both buffers, alive until the copy is known to be done."""

    def wait_compute(self) -> None:
        self._cp.cuda.get_current_stream().wait_event(self.end_event)

    def wait_host(self) -> None:
        self.end_event.synchronize()
        self._keep = None

    def done(self) -> bool:
        finished = bool(self.end_event.done)
        if finished:
            self._keep = None
        return finished

    def elapsed_ms(self) -> float:
        """Duration of the copy on the copy stream (waits for it)."""
        self.end_event.synchronize()
        return float(self._cp.cuda.get_elapsed_time(self.start_event, self.end_event))


class CudaCopies:
    """Pinned host buffers, device buffers on GPU `device_index`, and copies between them on one copy stream."""

    def __init__(self, device_index: int, pin_memory: bool = True) -> None:
        self._cp = import_cupy()
        self.device_index = device_index
        self.pin_memory = pin_memory
        """Pinned (page-locked) host buffers: asynchronous DMA. Pageable ones make each copy block the host."""
        with self._cp.cuda.Device(device_index):
            self.stream = self._cp.cuda.Stream(non_blocking=True)
            """The copy stream: non-blocking, so it does not synchronise with the legacy default stream."""

    def host_empty(self, n: int, dtype: Any) -> Array:
        if not self.pin_memory:
            return np.empty(n, dtype=dtype)
        import cupyx

        with self._cp.cuda.Device(self.device_index):
            return cupyx.empty_pinned(n, dtype=dtype)

    def device_empty(self, n: int, dtype: Any) -> Array:
        with self._cp.cuda.Device(self.device_index):
            return self._cp.empty(n, dtype=dtype)

    def upload(self, host: Array, device: Array) -> CudaTransfer:
        self._check(host, device)
        return self._copy(device.data.ptr, host.ctypes.data, host, device, self._cp.cuda.runtime.memcpyHostToDevice)

    def download(self, device: Array, host: Array) -> CudaTransfer:
        self._check(host, device)
        return self._copy(host.ctypes.data, device.data.ptr, host, device, self._cp.cuda.runtime.memcpyDeviceToHost)

    def _copy(self, dst: int, src: int, host: Array, device: Array, kind: int) -> CudaTransfer:
        cp = self._cp
        with cp.cuda.Device(self.device_index):
            issued = cp.cuda.Event(disable_timing=True)
            issued.record(cp.cuda.get_current_stream())
            self.stream.wait_event(issued)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            cp.cuda.runtime.memcpyAsync(dst, src, int(host.nbytes), kind, self.stream.ptr)
            end.record(self.stream)
        return CudaTransfer(cp, start, end, (host, device))

    def _check(self, host: Array, device: Array) -> None:
        if is_cupy_array(host) or not is_cupy_array(device):
            raise TypeError(f"offload copies go between a NumPy host buffer and a CuPy device buffer, got "
                            f"{type(host).__name__} and {type(device).__name__}")
        if host.dtype != device.dtype or host.size != device.size:
            raise ValueError(f"offload copy between {host.size} x {host.dtype} (host) and {device.size} x "
                             f"{device.dtype} (device): sizes and dtypes must match")
        if not (host.flags.c_contiguous and device.flags.c_contiguous):
            raise ValueError("offload copies need contiguous host and device buffers")
        if int(device.device.id) != self.device_index:
            raise ValueError(f"device buffer on GPU {device.device.id}, the copier serves GPU {self.device_index}")
