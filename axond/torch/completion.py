"""torch `Work` objects completed by axond's async `Work`s.

Each torch op starts one or more axond async ops (run in issue order on the axond group's communication thread).
One completion thread per group waits for them in issue order, runs the op's copy-back, then completes the op's
`AxondWork`. A thread that waits for the oldest op does all of that itself instead, running the axond ops too if
they have not started (`Completer.complete`): `dist.all_reduce(t)` then costs no thread hops. `wait()` re-raises
axond's own exception (a `DistributedError` naming op, group and peer), and `get_future()` (what DDP's reducer and
comm hooks chain on) completes with the output tensors or that exception.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from axond.distributed.work import Work as AxondAsync
from axond.errors import DistributedError

Finish = Callable[[list[Any]], Any]
"""Called with the axond Works' results once all finished; returns the op's output tensors."""


class AxondWork(dist._Work):
    """A torch Work whose failure is axond's exception, not a silent completion."""

    def __init__(self, op: str, group: str, limit: float, completer: Completer | None = None) -> None:
        super().__init__()
        self.op = op
        self.group = group
        self._limit = limit
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        self._completer = completer
        self._works: Sequence[AxondAsync] = ()
        self._then: Finish | None = None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op finished (at most the group timeout plus a margin); re-raise its failure."""
        unbounded = timeout is None or not timeout
        if unbounded and self._completer is not None and not self._done.is_set():
            self._completer.complete(self)
        limit = self._limit if unbounded else _seconds(timeout)
        if not self._done.wait(limit):
            raise DistributedError(f"{self.op} on group '{self.group}': did not finish within {limit:.1f} s",
                                   op=self.op, group=self.group)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        return self._future

    def synchronize(self) -> None:
        self.wait()


class DoneWork(dist._Work):
    """The torch Work of an op that already ran on the calling thread: no event to wait on, its future made only
    if asked for (small ops are mostly this bookkeeping)."""

    def __init__(self, op: str, group: str, value: Any = None, error: BaseException | None = None) -> None:
        super().__init__()
        self.op, self.group = op, group
        self._value, self._error = value, error
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(self._value)
        return self._future

    def synchronize(self) -> None:
        self.wait()


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)


class Completer:
    """Completes one group's torch Works, in issue order, on one daemon thread; or on the thread that waits for
    the oldest one (`complete`), which then runs its axond ops too if the group's communication thread has not
    started them (`CommThread.help`): a torch op waited for at once costs no thread hops."""

    def __init__(self, name: str, limit: float) -> None:
        self._name = name
        self._limit = limit
        self._queue: queue.SimpleQueue[AxondWork | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._order: deque[AxondWork] = deque()
        """The launched Works not completed yet, oldest first: only the oldest may complete."""

    def launch(self, op: str, works: Sequence[AxondAsync], finish: Finish) -> AxondWork:
        """The torch Work that completes once every one of `works` did and `finish` ran."""
        work = AxondWork(op, self._name, self._limit, self)
        work._works, work._then = works, finish
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"axond-torch-{self._name}", daemon=True)
                self._thread.start()
            self._order.append(work)
        self._queue.put(work)
        return work

    def complete(self, work: AxondWork) -> None:
        """On a thread that waits for `work`: if it is the oldest Work not completed, wait for its axond ops
        (running them here if not started), run its copy-back and complete it; else leave it to the thread."""
        if not self._order or self._order[0] is not work:
            return
        try:
            outcome: list[Any] | BaseException = [w.result() for w in work._works]  # runs them if not started
        except BaseException as e:
            outcome = e
        self._finish(work, outcome)

    def _finish(self, work: AxondWork, outcome: list[Any] | BaseException) -> None:
        """Complete `work` with its axond ops' results (or failure) unless another thread did."""
        with self._lock:
            if not self._order or self._order[0] is not work:
                return  # the other thread took it
            self._order.popleft()
        finish = work._then
        work._works, work._then = (), None  # a completed Work must not keep the op's tensors alive
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            assert finish is not None
            value = finish(outcome)
        except BaseException as e:
            work._finish(error=e)
        else:
            work._finish(value)

    def _loop(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                for w in work._works:  # a bounded wait does not run the op here: the communication thread does
                    if not w.wait(w._limit):
                        raise DistributedError(f"{w.op} on group '{w.group}': async op did not finish within "
                                               f"{w._limit:.1f} s", op=w.op, group=w.group)
                outcome: list[Any] | BaseException = [w.result() for w in work._works]
            except BaseException as e:
                outcome = e
            self._finish(work, outcome)
            del work, outcome  # an idle thread must not keep the last op's tensors alive

    def close(self, timeout: float) -> None:
        """Stop once the queued ops completed (bounded by `timeout`)."""
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
