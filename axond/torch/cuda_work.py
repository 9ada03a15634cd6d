"""`CudaWork`: the torch Work of an op on CUDA tensors, with the stream semantics of torch's NCCL backend.

The op runs on the axond NCCL group's stream, ordered after torch's current stream; its copy-backs run on
a side stream after it, which then records `ready`. `wait()` makes the caller's current stream wait for
`ready` and returns at once (the host does not block, as with torch's NCCL Work); `get_future()` is a
CUDA-aware torch future whose value is ready on any stream that waits on it (what DDP's reducer and comm
hooks chain on). A failure the NCCL watchdog detected (a hung or dead peer aborts the communicator) is
raised by `wait()`, `result()` and every later op on the group, as a `DistributedError` naming op, group
and peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from axond.errors import DistributedError
from axond.torch.errors import for_torch


class CudaWork(dist._Work):
    """A torch Work over axond `NcclWork`s whose copy-backs completed on a side stream that recorded `ready`."""

    def __init__(self, op: str, group: str, device: torch.device, works: Sequence[Any], ready: Any,
                 future: torch.futures.Future, value: Any) -> None:
        super().__init__()
        self.op, self.group = op, group
        self._device = device
        self._works = list(works)
        self._ready = ready
        self._future = future
        self._value = value

    def _check(self) -> None:
        """Raise the op's failure if the watchdog aborted it (never blocks: a probe of each NcclWork), as torch code
        catches it (`TorchDistributedError`, see `axond.torch.errors`)."""
        try:
            for work in self._works:
                work.wait(timeout=0)
        except DistributedError as e:
            raise for_torch(e) from None

    def wait(self, timeout: Any = None) -> bool:
        """Order the caller's current stream after the op (and its copy-backs); the host does not wait."""
        self._check()
        torch.cuda.current_stream(self._device).wait_event(self._ready)
        return True

    def is_completed(self) -> bool:
        return bool(self._ready.query())

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        try:
            self._check()
        except BaseException as e:  # noqa: BLE001 -- reported, not raised, as torch's Work.exception() does
            return e
        return None

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        return self._future

    def synchronize(self) -> None:
        self.wait()


def ready_after(works: Sequence[Any], side: Any, device: torch.device) -> None:
    """Make torch stream `side` wait (on the device) for the CUDA events of axond `NcclWork`s `works`."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        stream = cupy.cuda.ExternalStream(side.cuda_stream, index)
        for work in works:
            stream.wait_event(work.event)
