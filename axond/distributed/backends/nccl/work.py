"""`NcclWork`: the completion of one NCCL op, a CUDA event on the group's stream watched by the group's watchdog.

Stream semantics as torch's NCCL Work: `wait()` orders the caller's current stream after the op and returns
without blocking the host (ops whose result the host needs, NumPy arrays, wait on the host); `synchronize()`
waits on the host. A failure the watchdog detected is raised by `wait()`, `synchronize()`, `result()` and the
group's next op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from axond.distributed.backends.nccl.watchdog import WatchedOp

if TYPE_CHECKING:
    from axond.distributed.backends.nccl.backend import NcclBackend


class NcclWork:
    """Completion of one NCCL op, backed by a CUDA event on the group's stream.

    Same surface as `axond.distributed.work.Work`: `wait(timeout)`, `result()`, `is_completed()`, plus
    `synchronize()`.
    """

    __slots__ = ("op", "group", "_backend", "_watched", "_finish", "_result", "_error", "_finished")

    def __init__(self, backend: NcclBackend, watched: WatchedOp, finish: Callable[[], Any] | None,
                 value: Any = None) -> None:
        self.op = watched.op
        self.group = backend.group_name
        self._backend = backend
        self._watched = watched
        self._finish = finish
        self._result: Any = value
        self._error: BaseException | None = None
        self._finished = False

    @property
    def event(self) -> Any:
        """The CUDA event recorded on the group's stream after the op: a stream that waits on it
        (`stream.wait_event(work.event)`) sees the op's result. Pooled: once the op completed it may be recorded
        again behind a later op of the same stream, so a late wait on it waits at least as long as needed."""
        return self._watched.event

    @property
    def needs_host(self) -> bool:
        """Whether `wait()` blocks the host: the op's result is finished there (NumPy arrays, host-read sizes)."""
        return self._finish is not None

    def is_completed(self) -> bool:
        """True once the op has finished on the device or failed (never blocks)."""
        w = self._watched
        if self._finished or w.aborted or w.completed:
            return True
        try:
            return w.is_done()
        except Exception:  # noqa: BLE001 - a device failure is a completion (as failed); wait() raises it
            return True

    def is_success(self) -> bool:
        """True if the op finished and its result is valid."""
        return self.is_completed() and not self._watched.aborted and self._error is None

    def exception(self) -> BaseException | None:
        """The failure of a finished op, or None."""
        if self._error is None and self._watched.aborted:
            try:
                self.synchronize(timeout=0)
            except BaseException as e:  # noqa: BLE001 - reported, not raised (also kept in _error)
                return e
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Order the caller's current CuPy stream after the op and return (torch's `Work.wait()` on CUDA).

        The host blocks only where it must: ops finished on the host (NumPy arrays) and calls with `timeout`,
        which wait like `synchronize(timeout)`. Raises the op's failure if the watchdog aborted it.
        """
        if self._finished or self._finish is not None or timeout is not None or self._watched.aborted:
            return self.synchronize(timeout)
        self._backend._order_current_stream(self._watched.event)
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        """Block the host until the op completed and run its host-side finish; raise its failure
        (`DistributedError` on abort). With `timeout`, return False if it is still running then; without one,
        the group timeout bounds the wait."""
        if not self._finished:
            watchdog = self._backend._watchdog
            try:
                if not watchdog.wait(self._watched, timeout):
                    return False
                self._backend._order_current_stream(self._watched.event)
                watchdog.finished(self._watched)
                if self._finish is not None:
                    self._result = self._finish()
            except BaseException as e:  # noqa: BLE001 - kept, and raised by wait()
                self._error = e
            self._finished = True
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        """Wait (as `wait()`), then return the array the op produced (None for in-place ops)."""
        self.wait()
        return self._result
