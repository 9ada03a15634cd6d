"""torch `Work` objects completed by axond's async `Work`s.

Each torch op starts one or more axond async ops (run in issue order on the axond group's
communication thread). One completion thread per group waits for them in issue order, runs the
op's copy-back, then completes the op's `AxondWork`: `wait()` re-raises axond's own exception
(a `DistributedError` naming op, group and peer), and `get_future()` (what DDP's reducer and
comm hooks chain on) completes with the output tensors or that exception.
"""

from __future__ import annotations

import queue
import threading
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

    def __init__(self, op: str, group: str, limit: float) -> None:
        super().__init__()
        self.op = op
        self.group = group
        self._limit = limit
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op finished (at most the group timeout plus a margin); re-raise its failure."""
        limit = self._limit if timeout is None or not timeout else _seconds(timeout)
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
    """Completes one group's torch Works, in issue order, on one daemon thread."""

    def __init__(self, name: str, limit: float) -> None:
        self._name = name
        self._limit = limit
        self._queue: queue.SimpleQueue[tuple[Sequence[AxondAsync], Finish, AxondWork] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def launch(self, op: str, works: Sequence[AxondAsync], finish: Finish) -> AxondWork:
        """The torch Work that completes once every one of `works` did and `finish` ran."""
        work = AxondWork(op, self._name, self._limit)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"axond-torch-{self._name}", daemon=True)
                self._thread.start()
        self._queue.put((works, finish, work))
        return work

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            works, finish, work = item
            del item
            try:
                value = finish([w.result() for w in works])
            except BaseException as e:
                work._finish(error=e)
            else:
                work._finish(value)
            del works, finish, work  # an idle thread must not keep the last op's tensors alive

    def close(self, timeout: float) -> None:
        """Stop once the queued ops completed (bounded by `timeout`)."""
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
