"""Group commit: the changes of many calls written in one transaction, each answer sent once its batch is.

Calls change the in-memory state as before. At the end of each call (the state's lock released
with changes marked) the state says so (`changed`) and a commit is scheduled on the event loop,
behind the calls already ready to run there: when it runs it takes every change marked since the
previous batch (one `Changes`), writes it in one transaction and releases every answer waiting for
that batch. An answer waits (`durable`) for the batch holding everything the state had changed
when the answer was computed, so no client hears of a change, its own or another client's, before
it is committed; answers that find nothing uncommitted leave at once.

Where the transaction is written: on the event loop itself without fsync (a WAL append to the OS
cache costs ~0.1 ms, less than handing it to a thread and back under the GIL; under load commits
are `COMMIT_SPACING_S` apart), on one writer thread with fsync (a disk flush takes milliseconds,
during which the loop serves other calls and the next batch gathers).

Bounded: an answer waits at most `timeout` seconds (then UNAVAILABLE: the change may or may not
have been kept); a call that finds `max_batch` changed calls waiting for the next batch waits for
the commit in flight before it runs. A failed commit (a full disk, say) is written again every
`retry_interval` seconds, later changes gathering behind it: meanwhile the in-memory state holds
changes the disk does not, so every call answers UNAVAILABLE rather than tell a client something a
restart would forget; once the write succeeds the coordinator serves again by itself (`on_recover`),
and no answer it gave before was lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from axond.coordinator.state.errors import Unavailable
from axond.coordinator.state.port import Changes, Persistence

if TYPE_CHECKING:
    from axond.coordinator.state.machine import CoordinatorState

log = logging.getLogger("axond.coordinator")

COMMIT_SPACING_S = 0.002
"""Under load (this batch or the previous one holds more than one call) a commit starts no sooner than
this after the previous one, so one transaction holds the changes of many calls (each commit costs
~0.1 ms of the loop); a lone client's change is committed at once."""


RETRY_INTERVAL_S = 1.0
"""Seconds between attempts to write a batch whose write failed."""


class GroupCommit:
    """Commits a durable `CoordinatorState` in batches on the server's event loop; answers wait on it there."""

    def __init__(self, state: CoordinatorState, persistence: Persistence, loop: asyncio.AbstractEventLoop,
                 max_batch: int, timeout: float, writer_thread: bool = False,
                 on_failure: Callable[[], None] | None = None, on_recover: Callable[[], None] | None = None,
                 retry_interval: float | None = None, retry_failed: bool = True) -> None:
        """`writer_thread`: write each transaction on a thread of its own (for fsync) instead of on the loop;
        `on_failure` / `on_recover`: told when a commit fails, and when the failed batch was written after all;
        `retry_failed` False: a failed commit is final (a replica on etcd steps down instead, another takes over)."""
        self._state = state
        self._persistence = persistence
        self._loop = loop
        self._loop_thread: int | None = None
        self.max_batch = max_batch
        """Changed calls one batch gathers before new calls wait for the commit in flight."""
        self.timeout = timeout
        """Seconds an answer waits for its batch."""
        self._on_failure = on_failure or (lambda: None)
        self._on_recover = on_recover or (lambda: None)
        self.retry_interval = RETRY_INTERVAL_S if retry_interval is None else retry_interval
        self.retry_failed = retry_failed
        self._retry: tuple[int, int, Changes] | None = None
        """The batch whose write failed (number, calls, changes): written again until it succeeds."""
        self._retry_timer: asyncio.TimerHandle | None = None
        self.failures = 0
        """Failed writes so far (statistics)."""
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "axond-commit") if writer_thread else None
        self.taken = 0
        """Batches taken from the state (changed under the state's lock)."""
        self.needed = 0
        """The batch that holds (or will hold) the latest change (changed under the state's lock)."""
        self.pending_calls = 0
        """Calls that ended with changes since the last batch was taken."""
        self.committed = 0
        """Batches written."""
        self.failed: str | None = None
        """Why a commit failed; while set (until the batch is written after all), every call answers UNAVAILABLE."""
        self.batches = 0
        """Transactions written (statistics, like the two below)."""
        self.largest_batch = 0
        """Most changed calls one transaction held."""
        self.commit_seconds = 0.0
        """Time spent writing transactions."""
        self._last_calls = 0
        self._scheduled = False
        self._stopping = False
        self._last_commit = 0.0
        self._in_flight: asyncio.Future[None] | None = None
        self._futures: dict[int, tuple[list[asyncio.Future[None]], asyncio.TimerHandle]] = {}
        """Per batch someone waits for: each waiter's future (completed by the commit), and the timer that
        gives up on the batch."""

    def start(self) -> None:
        """Commit in batches from now on (call on the loop; the state stops committing at the end of each call)."""
        self._loop_thread = threading.get_ident()
        self._state.commit_later(self.changed)

    async def stop(self) -> None:
        """Commit what is left (waits at most `timeout` seconds for a write in flight)."""
        self._stopping = True
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        if self._in_flight is not None:
            await asyncio.wait([self._in_flight], timeout=self.timeout)
        if self._in_flight is None and self._retry is not None:
            self._write_batch(*self._retry)  # a last try for the batch whose write failed
            if self._in_flight is not None:
                await asyncio.wait([self._in_flight], timeout=self.timeout)
        if self._in_flight is None:
            self._commit(last=True)
        if self._in_flight is not None:
            await asyncio.wait([self._in_flight], timeout=self.timeout)
        if self._writer is not None:
            self._writer.shutdown(wait=False)
        if self._state.uncommitted() and self.failed is None:
            log.error("the coordinator stopped with changes it could not commit in %.0f s", self.timeout)

    def changed(self) -> None:
        """End of a call, under the state's lock: if anything is uncommitted, it goes in the next batch."""
        if self._state.uncommitted():
            self.needed = self.taken + 1
            self.pending_calls += 1
            if not self._scheduled:
                self._scheduled = True
                if threading.get_ident() == self._loop_thread:
                    self._loop.call_soon(self._commit)
                else:
                    self._call_soon_threadsafe(self._commit)

    async def durable(self) -> None:
        """Return once everything the state has changed so far is committed; UNAVAILABLE otherwise."""
        need = self.needed
        if self.failed is None and self.committed >= need:
            return
        await self._until_committed(need)

    async def room(self) -> None:
        """Before a call runs: while `max_batch` changed calls wait for the next batch, wait for a commit."""
        deadline = time.monotonic() + self.timeout
        while self.pending_calls >= self.max_batch or self.failed is not None:
            if time.monotonic() > deadline:
                raise Unavailable(f"the coordinator is {self.pending_calls} changes behind its disk; retry later")
            await self._until_committed(self.taken if self.committed < self.taken else self.taken + 1)

    async def _until_committed(self, batch: int) -> None:
        """Wait (at most `timeout` seconds from the first waiter) until `batch` is committed."""
        if self.failed is not None:
            raise Unavailable(self.failed)
        waiting = self._futures.get(batch)
        if waiting is None:
            waiting = self._futures[batch] = ([], self._loop.call_later(self.timeout, self._expire, batch))
        fut = self._loop.create_future()
        waiting[0].append(fut)
        await fut
        if self.failed is not None:
            raise Unavailable(self.failed)
        if self.committed < batch:
            raise Unavailable(
                f"the coordinator did not commit this call's change within {self.timeout:g} s (commit_timeout_s); "
                "it may or may not have been kept: check, then retry"
            )

    def _expire(self, batch: int) -> None:
        waiters, _ = self._futures.pop(batch, ([], None))
        self._wake(waiters)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _commit(self, last: bool = False) -> None:
        """On the loop: take every marked change as the next batch and write it (unless a write is in flight);
        `last`: the one `stop` asks for (no spacing; no commit runs after it)."""
        if self._stopping and not last:
            return
        early = self._last_commit + COMMIT_SPACING_S - time.perf_counter()
        if early > 0 and not last and max(self.pending_calls, self._last_calls) > 1:
            self._loop.call_later(early, self._commit)
            return
        self._scheduled = False
        if self._in_flight is not None or self.failed is not None:
            return
        with self._state.lock:
            if not self._state.uncommitted():
                return
            changes = self._state.take_changes()
            calls, self.pending_calls = self.pending_calls, 0
            self._last_calls = calls
            self.taken += 1
            batch = self.taken
        self._write_batch(batch, calls, changes)

    def _write_batch(self, batch: int, calls: int, changes: Changes) -> None:
        t0 = self._last_commit = time.perf_counter()
        if self._writer is None:
            try:
                self._persistence.commit(changes)
            except Exception as e:
                self._fail(e, batch, calls, changes)
                return
            self._written_ok(batch, calls, t0)
            return
        self._in_flight = asyncio.wrap_future(self._writer.submit(self._write, changes))
        self._in_flight.add_done_callback(lambda f: self._written(f, batch, calls, t0, changes))

    def _write(self, changes: Changes) -> None:
        self._persistence.commit(changes)

    def _written(self, fut: asyncio.Future[None], batch: int, calls: int, t0: float, changes: Changes) -> None:
        self._in_flight = None
        e = fut.exception()
        if e is not None:
            self._fail(e, batch, calls, changes)
            return
        self._written_ok(batch, calls, t0)

    def _written_ok(self, batch: int, calls: int, t0: float) -> None:
        recovered = self.failed is not None
        if recovered:
            log.warning("the coordinator wrote its state again after %d failed attempts; serving again", self.failures)
            self.failed, self._retry = None, None
        self._done(batch, calls, t0)
        if recovered:
            self._on_recover()
        if not self._scheduled and (self.pending_calls or recovered) and not self._stopping:
            self._scheduled = True
            self._loop.call_soon(self._commit)

    def _write_again(self) -> None:
        self._retry_timer = None
        if self._retry is not None and not self._stopping and self._in_flight is None:
            self._write_batch(*self._retry)

    def _done(self, batch: int, calls: int, t0: float) -> None:
        self.committed = batch
        self.commit_seconds += time.perf_counter() - t0
        self.batches += 1
        self.largest_batch = max(self.largest_batch, calls)
        for b in [b for b in self._futures if b <= batch]:
            waiters, timer = self._futures.pop(b)
            timer.cancel()
            self._wake(waiters)

    def _fail(self, e: BaseException, batch: int, calls: int, changes: Changes) -> None:
        first = self.failed is None
        self.failures += 1
        then = (f"it writes it again every {self.retry_interval:g} s and answers calls again once that succeeds: "
                "free space in its state directory (disk full?) or fix its permissions") if self.retry_failed else (
                "it answers no call any more; another replica takes over from what was committed")
        self.failed = f"the coordinator could not write its state ({type(e).__name__}: {e}); {then}"
        self._retry = (batch, calls, changes) if self.retry_failed else None
        if first:
            log.error("%s", self.failed)
            for waiters, timer in self._futures.values():
                timer.cancel()
                self._wake(waiters)
            self._futures.clear()
            self._on_failure()
        if not self._stopping and self._retry is not None:
            self._retry_timer = self._loop.call_later(self.retry_interval, self._write_again)

    def _call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop has closed: the server stopped and no answer waits any more
