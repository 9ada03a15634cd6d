"""Wake-ups for coroutines waiting on state changes, without a thread per waiter."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

Topic = tuple[Hashable, ...]
T = TypeVar("T")


class WaitHub:
    """Futures keyed by topic, completed by `notify` (callable from any thread).

    Waiters check the state and register in the same step of the event loop, and every
    notification runs on the loop, so no wake-up is lost between the check and the wait.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._waiters: dict[Topic, set[asyncio.Future[None]]] = {}

    def notify(self, topic: Topic) -> None:
        if threading.get_ident() == self._loop_thread:
            self._wake(topic)
        else:
            try:
                self._loop.call_soon_threadsafe(self._wake, topic)
            except RuntimeError:
                pass  # the loop has closed: the server stopped and nobody waits any more

    def _wake(self, topic: Topic) -> None:
        for fut in self._waiters.pop(topic, ()):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, topics: Sequence[Topic], timeout: float) -> None:
        """Return when any of `topics` is notified or after `timeout` seconds."""
        fut: asyncio.Future[None] = self._loop.create_future()
        for topic in topics:
            self._waiters.setdefault(topic, set()).add(fut)
        timer = self._loop.call_later(max(0.0, timeout), _wake_one, fut)  # (cheaper than asyncio.wait per waiter)
        try:
            await fut
        finally:
            timer.cancel()
            for topic in topics:
                waiting = self._waiters.get(topic)
                if waiting is not None:
                    waiting.discard(fut)
                    if not waiting:
                        del self._waiters[topic]

    async def until(
        self, seconds: float, check: Callable[[], T | None], topics: Callable[[], Sequence[Topic]]
    ) -> T | None:
        """Call `check` until it returns a value, waking on `topics()`; None after `seconds`."""
        deadline = self._loop.time() + seconds
        while True:
            result = check()
            if result is not None:
                return result
            left = deadline - self._loop.time()
            if left <= 0:
                return None
            await self.wait(topics(), left)


def _wake_one(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
