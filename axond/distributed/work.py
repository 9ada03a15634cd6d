"""Asynchronous ops: `Work` handles and the per-group communication thread that runs them in issue order."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from axond.distributed.diagnostics.failure import concise, debug
from axond.errors import DistributedError


class PendingSend:
    """An isend that was handed to the transport: done once its bytes left this process."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[float, bool], bool]) -> None:
        self.done = done
        self._wait = wait

    def wait(self, timeout: float, strict: bool) -> bool:
        """Wait up to `timeout` s; False if still sending (raises instead when `strict`)."""
        return self._wait(timeout, strict)


_CALLBACKS = threading.Lock()
"""Guards every Work's callbacks against its finishing (held for a few attribute writes)."""


class Work:
    """Handle of an async op: `wait()` blocks until it finished and re-raises its failure."""

    def __init__(self, op: str, group: str, limit: float, comm: OpQueue | None = None) -> None:
        self.op = op
        self.group = group
        self._limit = limit
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._comm = comm
        """The communication thread that runs the op (`wait` may run it instead, see `OpQueue.help`)."""
        self._callbacks: list[Callable[[Work], None]] | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result = result
        self._error = error
        with _CALLBACKS:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call `fn(work)` once the op finished (successfully or not): at once if it has, else on the thread that
        finishes it, before that thread starts the next op. `fn` must not raise."""
        with _CALLBACKS:
            if not self._done.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not); never blocks."""
        if not self._done.is_set():
            return False
        return not isinstance(self._result, PendingSend) or self._result.done()

    def is_success(self) -> bool:
        """True if the op finished without error."""
        return self.is_completed() and self._error is None

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Wait for the op; re-raise its failure. With `timeout` (seconds or a timedelta), return False if it
        is still running then.

        Without one, wait at most the group timeout plus a margin (the op itself is bounded by it); an op that
        has not started yet then runs on the calling thread (`OpQueue.help`).
        """
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if timeout is None and self._comm is not None and not self._done.is_set():
            self._comm.help(self)
        limit = self._limit if timeout is None else timeout
        if not self._done.wait(limit):
            if timeout is not None:
                return False
            raise DistributedError(f"{self.op} on group '{self.group}': async op did not finish within {limit:.1f} s",
                                   op=self.op, group=self.group, timed_out=True)
        if self._error is not None:
            if isinstance(self._error, DistributedError) and not debug():
                raise concise(self._error) from None
            raise self._error
        if isinstance(self._result, PendingSend):
            if not self._result.wait(limit, timeout is None):
                return False
            self._result = None
        return True

    def result(self) -> Any:
        """Wait, then return the array produced by ops that return one (None for in-place ops)."""
        self.wait()
        return self._result

    def exception(self) -> BaseException | None:
        """The failure of a finished op, or None."""
        return self._error if self._done.is_set() else None


class OpQueue:
    """A group's queue of async ops, run one after another in issue order on one thread (started on first use).

    A caller that waits for an op the thread has not started (`Work.wait` without a timeout, `drain`) runs the ops
    queued up to it itself (`help`), so a `wait()` right after `async_op=True` does not wait for the thread to wake.
    Either way one op runs at a time, in issue order.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Work, Callable[[], Any]]] = deque()
        self._pending: deque[Work] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._running = False
        """Whether an op runs now, on this thread or a helping caller's."""

    def submit(self, work: Work, fn: Callable[[], Any]) -> Work:
        with self._cond:
            if self._closed:
                raise DistributedError(f"{work.op} on group '{work.group}': the group was destroyed",
                                       op=work.op, group=work.group)
            self._queue.append((work, fn))
            self._pending.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"axond-comm-{self._name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return work

    @property
    def pending(self) -> bool:
        """Whether async ops were submitted that `drain` has not seen finish."""
        return bool(self._pending)

    def drain(self) -> None:
        """Wait until every submitted op ran (so a blocking op keeps issue order); failures stay in their Work.

        An isend counts once handed to the transport, so `isend(); recv()` works on both sides at once.
        """
        if not self._pending:
            return
        while True:
            with self._cond:
                while self._pending and self._pending[0]._done.is_set():
                    self._pending.popleft()
                if not self._pending:
                    return
                work = self._pending[0]
            self.help(work)
            work._done.wait(work._limit)
            if not work._done.is_set():
                raise DistributedError(f"{work.op} on group '{work.group}': an earlier async op is stuck",
                                       op=work.op, group=work.group)

    def help(self, work: Work) -> None:
        """Run the queued ops up to `work` on the calling thread, one by one, while no op is running (the thread
        has not picked them up yet); return once `work` finished or another thread runs an op."""
        while not work._done.is_set():
            with self._cond:
                if self._running or not self._queue:
                    return
                item = self._queue.popleft()
                self._running = True
            try:
                self._run_one(*item)
            finally:
                del item
                self._ran()

    def _ran(self) -> None:
        """After an op: let the next one start; forget the finished Works (their results) until the next drain."""
        with self._cond:
            self._running = False
            while self._pending and self._pending[0]._done.is_set():
                self._pending.popleft()
            if self._queue or self._closed:  # the thread waits for the next op, or to stop
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running or not self._queue:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait(1.0)
                item = self._queue.popleft()
                self._running = True
            try:
                self._run_one(*item)
            finally:
                del item  # an idle thread must not keep the last op's arrays alive (FSDP frees them at once)
                self._ran()

    @staticmethod
    def _run_one(work: Work, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as e:
            work._finish(error=e)
        else:
            work._finish(result)

    def close(self, timeout: float) -> None:
        """Stop after the queued ops ran (bounded by `timeout`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
