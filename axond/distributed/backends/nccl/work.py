"""`NcclWork`: the completion of one NCCL op, a CUDA event on the group's stream watched by the group's watchdog."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from axond.distributed.backends.nccl.watchdog import WatchedOp

if TYPE_CHECKING:
    from axond.distributed.backends.nccl.backend import NcclBackend


class NcclWork:
    """Completion of one NCCL op, backed by a CUDA event on the group's stream.

    Same surface as `axond.distributed.work.Work`: `wait(timeout)`, `result()`, `is_completed()`.
    """

    def __init__(self, backend: NcclBackend, watched: WatchedOp, event: Any, finish: Callable[[], Any] | None) -> None:
        self.op = watched.op
        self.group = backend.group_name
        self._backend = backend
        self._watched = watched
        self._event = event
        self._finish = finish
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished = False

    @property
    def event(self) -> Any:
        """The CUDA event recorded on the group's stream after the op: a caller's stream that waits on it
        (`stream.wait_event(work.event)`) sees the op's result without blocking the host (the torch backend's
        CUDA path does this). In-place ops on contiguous CuPy arrays need nothing more; staged ones need `wait()`."""
        return self._event

    def is_completed(self) -> bool:
        """True once the op has finished on the device or failed (never blocks)."""
        return self._finished or self._watched.aborted or bool(self._event.done)

    def is_success(self) -> bool:
        """True if the op finished and its result is valid."""
        return self._finished and self._error is None

    def exception(self) -> BaseException | None:
        """The failure of a finished op, or None."""
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the op and run its host-side finish; raise its failure (`DistributedError` on abort).

        With `timeout`, return False if it is still running then; without one, the group timeout bounds it.
        """
        if not self._finished:
            watchdog = self._backend._watchdog
            try:
                if not watchdog.wait(self._watched, timeout):
                    return False
                watchdog.finished(self._watched)
                with self._backend._device:
                    self._backend._cp.cuda.get_current_stream().wait_event(self._event)
                    if self._finish is not None:
                        self._result = self._finish()
            except BaseException as e:  # noqa: BLE001 - kept, and raised by wait()
                self._error = e
            self._finished = True
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        """Wait, then return the array the op produced (None for in-place ops)."""
        self.wait()
        return self._result
