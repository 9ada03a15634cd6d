"""`CudaWork`: the torch Work of an op on CUDA tensors, with the stream semantics of torch's NCCL backend.

The op runs on the axond NCCL group's stream, ordered after torch's current stream; its copy-backs run on
a side stream after it, which then records `ready`. `wait()` makes the caller's current stream wait for
`ready` and returns at once (the host does not block, as with torch's NCCL Work); `synchronize()` waits on the
host; `get_future()` is a CUDA-aware torch future whose value is ready on any stream that waits on it (what
DDP's reducer and comm hooks chain on), built on the first call only (most ops are never asked for one).
A failure the NCCL watchdog detected (a hung or dead peer aborts the communicator) is raised by `wait()`,
`synchronize()`, `result()` and every later op on the group, as a `DistributedError` naming op, group and peer.
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
                 side: Any, value: Any) -> None:
        super().__init__()
        self.op, self.group = op, group
        self._device = device
        self._works = works
        self._ready = ready
        self._side = side
        self._future: torch.futures.Future | None = None
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
        """A CUDA-aware future completed with the op's value on the side stream (which is past the op's copy-backs
        by now, and perhaps past later ones: waiting on it never waits too little)."""
        if self._future is None:
            future: torch.futures.Future = torch.futures.Future(devices=[self._device])
            with torch.cuda.stream(self._side):
                future.set_result(self._value)
            self._future = future
        return self._future

    def synchronize(self) -> None:
        """Block the host until the op and its copy-backs completed on the device (raises the op's failure)."""
        self._check()
        self._ready.synchronize()
        self._check()


def ready_after(works: Sequence[Any], side: Any) -> None:
    """Make the CuPy view `side` of a torch stream wait (on the device) for the events of axond `NcclWork`s `works`."""
    for work in works:
        side.wait_event(work.event)
