"""Group commit: the changes of many calls written in one transaction by one background thread.

Calls change the in-memory state as before. At the end of each call (the state's lock released
with changes marked) the state says so (`changed`). The committer thread takes every change marked
since its last batch (under the lock, as one `Changes`), writes it in one transaction (outside the
lock, while the event loop serves other calls) and then releases every reply waiting for that
batch. A reply waits (`durable`) for the batch holding everything the state had changed when the
reply was computed, so no client hears of a change, its own or another client's, before it is
committed; reads of committed state answer at once.

Bounded: a reply waits at most `commit_timeout_s` (then UNAVAILABLE: the change may or may not
have been kept); a call that finds `max_commit_batch` changed calls waiting for the next batch
waits for the commit in flight before it runs. A failed commit is final: the in-memory state then
holds changes the disk does not, so every later call answers UNAVAILABLE until the coordinator is
restarted (from what was committed) rather than tell a client something a restart would forget.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from axond.coordinator.errors import Unavailable
from axond.coordinator.persistence.base import Persistence

if TYPE_CHECKING:
    from axond.coordinator.state import CoordinatorState

log = logging.getLogger("axond.coordinator")

IDLE_WAKE_S = 0.5
"""The committer re-checks for work (and for stop) at least this often."""


class GroupCommit:
    """One committer thread for a durable `CoordinatorState`; replies wait on it from the event loop."""

    def __init__(self, state: CoordinatorState, persistence: Persistence, loop: asyncio.AbstractEventLoop,
                 max_batch: int, timeout: float, on_failure: Callable[[], None] | None = None) -> None:
        self._state = state
        self._persistence = persistence
        self._loop = loop
        self.max_batch = max_batch
        """Changed calls one batch gathers before new calls wait for the commit in flight."""
        self.timeout = timeout
        """Seconds a reply waits for its batch."""
        self._on_failure = on_failure or (lambda: None)
        self.taken = 0
        """Batches taken from the state (changed under the state's lock)."""
        self.needed = 0
        """The batch that holds (or will hold) the latest change (changed under the state's lock)."""
        self.pending_calls = 0
        """Calls that ended with changes since the last batch was taken."""
        self.committed = 0
        """Batches written (changed by the committer thread only)."""
        self.failed: str | None = None
        """Why a commit failed; once set, every call answers UNAVAILABLE."""
        self.batches = 0
        self.largest_batch = 0
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="axond-commit", daemon=True)

    def start(self) -> None:
        """Commit in the background from now on (the state stops committing at the end of each call)."""
        self._state.commit_later(self.changed)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Commit what is left, then end the thread (waits at most `timeout` seconds)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the coordinator's committer did not finish within %.0f s; the last changes may be lost",
                      timeout)

    def changed(self) -> None:
        """End of a call, under the state's lock: if anything is uncommitted, it goes in the next batch."""
        if self._state.uncommitted():
            self.needed = self.taken + 1
            self.pending_calls += 1
            if not self._wake.is_set():
                self._wake.set()

    async def durable(self, seconds: float) -> None:
        """Return once everything the state has changed so far is committed; UNAVAILABLE otherwise."""
        need = self.needed
        if self.failed is None and self.committed >= need:
            return
        await self._until_committed(need, seconds)

    async def room(self, seconds: float) -> None:
        """Before a call runs: while `max_batch` changed calls wait for the next batch, wait for a commit."""
        deadline = time.monotonic() + seconds
        while self.pending_calls >= self.max_batch or self.failed is not None:
            in_flight = self.taken if self.committed < self.taken else self.taken + 1
            await self._until_committed(in_flight, deadline - time.monotonic())

    async def _until_committed(self, batch: int, seconds: float) -> None:
        if self.failed is not None:
            raise Unavailable(self.failed)
        fut = self._futures.get(batch)
        if fut is None:
            fut = self._futures[batch] = self._loop.create_future()
        if self.committed < batch:
            await asyncio.wait([fut], timeout=max(0.0, seconds))
        if self.failed is not None:
            raise Unavailable(self.failed)
        if self.committed < batch:
            raise Unavailable(
                f"the coordinator did not commit this call's change within {seconds:.3g} s (commit_timeout_s or "
                "the call's deadline); it may or may not have been kept: check, then retry"
            )

    def _release(self, batch: int) -> None:
        """On the loop: wake every reply waiting for a batch up to `batch`."""
        for b in [b for b in self._futures if b <= batch or self.failed is not None]:
            fut = self._futures.pop(b)
            if not fut.done():
                fut.set_result(None)

    def _fail(self) -> None:
        self._release(self.taken)
        self._on_failure()

    def _run(self) -> None:
        while True:
            if not self._stopping:
                self._wake.wait(IDLE_WAKE_S)
            self._wake.clear()
            with self._state.lock:
                if not self._state.uncommitted():
                    if self._stopping:
                        return
                    continue
                changes = self._state.take_changes()
                calls, self.pending_calls = self.pending_calls, 0
                self.taken += 1
                batch = self.taken
            try:
                self._persistence.commit(changes)
            except Exception as e:
                self.failed = (
                    f"the coordinator could not write its state ({type(e).__name__}: {e}); it answers no call "
                    "until restarted: check its state directory (disk full? permissions?) and restart it, and "
                    "it carries on from what it had committed"
                )
                log.error("%s", self.failed)
                self._call_soon(self._fail)
                return
            self.committed = batch
            self.batches += 1
            self.largest_batch = max(self.largest_batch, calls)
            self._call_soon(self._release, batch)

    def _call_soon(self, fn: Callable[..., None], *args: int) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop has closed: the server stopped and no reply waits any more
