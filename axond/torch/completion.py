"""torch `Work` objects completed by axond's async `Work`s.

Each torch op starts one or more axond async ops (run in issue order on the axond group's communication thread).
A collective's `AxondWork` is done as soon as its last axond op finished: the thread that finished it runs the
op's copy-back and records the outcome, so `wait()` costs no thread hop (and a `wait()` on ops not started yet runs
them on the waiting thread). Its torch future, which DDP's reducer and comm hooks chain on, is completed on a
completion thread (see `Completer`). `wait()` re-raises axond's own exception (a `DistributedError` naming op,
group and peer, as a `TorchDistributedError`: see `axond.torch.errors`).

A failed op's future is completed with an error torch's C++ code sees (`failed_future`), never with the exception
as its value: DDP's reducer reads a future's value as tensors, and an exception object there crashed it (SIGSEGV in
`parseCppCommHookResult`). Asked for its future inside a backward pass (DDP's buckets, comm hooks), a collective's
Work also queues an autograd callback that raises its failure before the reducer finalizes (`check_in_backward`), so
`loss.backward()` raises axond's error itself rather than the future's RuntimeError wrapping it.
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
from axond.torch.errors import for_torch

Finish = Callable[[list[Any]], Any]
"""Called with the axond Works' results once all finished; returns the op's output tensors."""


def _raise(error: BaseException) -> Callable[[Any], Any]:
    def fail(_: Any) -> Any:
        raise error
    return fail


def failed_future(error: BaseException) -> torch.futures.Future:
    """A future completed with `error` as an error (C++ `value()` throws), not as its value: a callback that
    raises is the one way Python has to complete a torch future so (`Future.set_exception` stores the exception
    as the value, which DDP's reducer then reads as tensors)."""
    base: torch.futures.Future = torch.futures.Future()
    failed = base.then(_raise(error))
    base.set_result(None)
    return failed


def check_in_backward(check: Callable[[], Any]) -> None:
    """Inside a backward pass, have autograd run `check` (which raises a failure) once the pass's nodes ran,
    before the callbacks queued after it (DDP's reducer queues its finalization after its buckets' ops)."""
    if torch._C._current_graph_task_id() != -1:
        torch.autograd.Variable._execution_engine.queue_callback(check)


class AxondWork(dist._Work):
    """A torch Work whose failure is axond's exception, not a silent completion."""

    def __init__(self, op: str, group: str, limit: float, completer: Completer | None = None,
                 collective: bool = True) -> None:
        super().__init__()
        self.op = op
        self.group = group
        self._limit = limit
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        """Completed with None either way; what torch sees is `_exposed`, which raises a failure as an error."""
        self._exposed: torch.futures.Future | None = None
        self._completer = completer
        self._collective = collective
        self._works: Sequence[AxondAsync] = ()
        self.source: list[int] = []
        """The sender's group rank, once a receive from any source finished."""

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome (what `wait` returns or raises); the future is completed apart (`_complete_future`),
        as completing it runs torch's callbacks, which may block on later ops."""
        self._value = value
        self._error = None if error is None else for_torch(error, self._timeout())
        self._done.set()

    def _timeout(self) -> float | None:
        return self._completer.timeout if self._completer is not None else None

    def _complete_future(self) -> None:
        self._future.set_result(None)

    def _outcome(self, _: Any) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op finished (at most the group timeout plus a margin); re-raise its failure."""
        unbounded = timeout is None or not timeout
        if unbounded and self._completer is not None and not self._done.is_set():
            self._completer.complete(self)
        limit = self._limit if unbounded else _seconds(timeout)
        if not self._done.wait(limit):
            raise for_torch(DistributedError(f"{self.op} on group '{self.group}': did not finish within {limit:.1f} s",
                                             op=self.op, group=self.group, timed_out=True), limit)
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

    def _source_rank(self) -> int:
        """The sender of a receive from any source (torch's `irecv(t)` without src: `work._source_rank()`)."""
        self.wait()
        return int(self.source[0]) if self.source else -1

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        """The future torch chains on: the output tensors, or the failure as an error; in a backward pass, a
        collective's failure is also raised by an autograd callback (`check_in_backward`)."""
        if self._exposed is None:
            self._exposed = self._future.then(self._outcome)
            if self._collective and not self.is_success():
                check_in_backward(self.wait)
        return self._exposed

    def synchronize(self) -> None:
        self.wait()


class Posted:
    """A send posted on the calling thread (`ProcessGroup.post_send`) as a completion job waits for it: `result()`
    returns once its bytes left (a `PendingSend`, nothing left to wait for, or the Work of a queued isend)."""

    __slots__ = ("_pending", "_limit")

    def __init__(self, pending: Any, limit: float) -> None:
        self._pending, self._limit = pending, limit

    def result(self) -> None:
        if self._pending is None:
            return
        if isinstance(self._pending, AxondAsync):
            self._pending.wait()
        else:
            self._pending.wait(self._limit, True)


class DoneWork(dist._Work):
    """The torch Work of an op that already ran on the calling thread: no event to wait on, its future made only
    if asked for (small ops are mostly this bookkeeping)."""

    def __init__(self, op: str, group: str, value: Any = None, error: BaseException | None = None,
                 timeout: float | None = None) -> None:
        super().__init__()
        self.op, self.group = op, group
        self._value = value
        self._error = None if error is None else for_torch(error, timeout)
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
            if self._error is not None:
                self._future = failed_future(self._error)
                check_in_backward(self.wait)
            else:
                self._future = torch.futures.Future()
                self._future.set_result(self._value)
        return self._future

    def synchronize(self) -> None:
        self.wait()


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)


class Completer:
    """Completes one group's torch Works.

    A collective's Work (`follow`) is completed by the thread that finishes its last axond op: the group's
    communication thread, or a thread that waits for the Work and runs the ops itself if they have not started
    (`complete`, `OpQueue.help`). A send's or receive's Work (`launch`) is completed once its axond ops finished
    (a send's bytes left), on a completion thread. Futures are completed on completion threads: that runs torch's
    callbacks (DDP's reducer, comm hooks), which may start further ops of the group and block on them (PowerSGD
    does), so a callback must never block the thread that completes those. A completion thread is started whenever
    a job arrives and none is free (at most MAX_THREADS); those beyond the first end after IDLE_SECONDS without work.
    """

    MAX_THREADS = 8
    IDLE_SECONDS = 2.0

    def __init__(self, name: str, limit: float, timeout: float | None = None) -> None:
        self._name = name
        self._limit = limit
        self.timeout = timeout
        """The group's timeout (seconds), quoted by timeout errors."""
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._free = 0
        """Completion threads waiting for a job."""
        self._closed = False

    def follow(self, op: str, works: Sequence[AxondAsync], finish: Finish) -> AxondWork:
        """The torch Work of collective `works`: done (after `finish`, the copy-back) as soon as the last of them
        finished, on the thread that finished it, before that thread starts the next op: no thread hop for
        `wait()`. Not for sends, whose completion waits for their bytes to leave (`launch`)."""
        if not all(isinstance(w, AxondAsync) for w in works):
            return self.launch(op, works, finish)
        work = AxondWork(op, self._name, self._limit, self)
        work._works = works

        def settle(_: object) -> None:
            try:  # every op has finished (they run in issue order): their results, or the first failure
                value = finish([w.result() for w in works])
            except BaseException as e:
                work._finish(error=e)
            else:
                work._finish(value)
            work._works = ()
            self._submit(work._complete_future)

        if works:
            works[-1].add_done_callback(settle)
        else:
            settle(None)
        return work

    def launch(self, op: str, works: Sequence[AxondAsync], finish: Finish) -> AxondWork:
        """The torch Work that completes, on a completion thread, once every one of `works` did (`wait()`: a send's
        bytes left) and `finish` ran."""
        work = AxondWork(op, self._name, self._limit, self, collective=False)

        def job() -> None:
            try:
                value = finish([w.result() for w in works])
            except BaseException as e:
                work._finish(error=e)
            else:
                work._finish(value)
            work._complete_future()

        self._submit(job)
        return work

    def complete(self, work: AxondWork) -> None:
        """On a thread that waits for `work`: run its axond ops here if they have not started (`OpQueue.help`);
        a collective's Work then completes here too."""
        for w in work._works:
            try:
                w.wait()
            except BaseException:  # noqa: S112 -- its failure completes `work`
                continue

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                start = None
            elif self._free == 0 and len(self._threads) < self.MAX_THREADS:
                start = threading.Thread(target=self._loop, args=(not self._threads,),
                                         name=f"axond-torch-{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(start)
                self._free += 1
            else:
                start = None
        if start is None and self._closed:
            job()  # after close: nobody else will (the group's ops have finished)
            return
        self._jobs.put(job)
        if start is not None:
            start.start()

    def _loop(self, first: bool) -> None:
        """A completion thread: runs jobs; the first one stays until `close`, the others end after IDLE_SECONDS
        without a job."""
        me = threading.current_thread()
        while True:
            try:
                job = self._jobs.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if not (first and not self._closed) and self._jobs.empty():
                        self._free -= 1
                        self._threads.remove(me)
                        return
                continue
            with self._lock:
                self._free -= 1
            if job is None:
                with self._lock:
                    self._threads.remove(me)
                return
            try:
                job()
            except BaseException:  # noqa: S110 -- a job records its own failure; a torch callback's is torch's
                pass
            del job  # an idle thread must not keep the last op's tensors alive
            with self._lock:
                self._free += 1

    def close(self, timeout: float) -> None:
        """Stop once the queued jobs ran (bounded by `timeout`)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            if t is not threading.current_thread() and t.ident is not None:  # one `_submit` is starting may not be yet
                t.join(timeout)
