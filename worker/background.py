"""Store reads the worker's monitor loop makes without waiting on the coordinator.

The monitor loop stops the ranks by the fencing deadline (`axond/fencing.py`); a read of the coordinator's store from
that loop would wait out its call timeout whenever the coordinator cannot be reached (a partition that drops the
packets), and push the deadline by as much. `Background` runs such a read on a thread of its own and waits for it
at most `WAIT_S` (a read on a reachable coordinator takes milliseconds); past that the caller gets the newest earlier
result for the same ranks (None if there is none), and no second read starts while one is in flight. The read's
own calls must be short (the worker gives them a client of their own with a short call timeout). `close` ends it: no
read starts after it, and it waits (bounded) for the one in flight, so that no read is left inside gRPC when the
process exits (the interpreter stops daemon threads wherever they are at exit; one stopped inside a gRPC call can hang
the exit: see `axond.control.kv_stream._OPEN`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R")

WAIT_S = 0.02
"""The longest a call waits for its read: well inside the fencing overrun (`FENCE_OVERRUN_S`, 0.25 s)."""


class Background(Generic[R]):
    """`read(ranks)` off the caller's thread, waited for at most `wait_s`; at most one read in flight."""

    def __init__(self, read: Callable[[Sequence[int]], R | None], name: str, wait_s: float = WAIT_S) -> None:
        self._read, self._name, self._wait_s = read, name, wait_s
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._reads = 0
        self._done: tuple[tuple[int, ...], R | None] | None = None

    def __call__(self, ranks: Sequence[int]) -> R | None:
        key = tuple(ranks)
        with self._cond:
            if not self._busy and not self._closed:
                self._busy = True
                target = self._reads + 1
                threading.Thread(target=self._run, args=(key,), name=self._name).start()
                self._cond.wait_for(lambda: self._reads >= target, timeout=self._wait_s)
            done = self._done
        return done[1] if done is not None and done[0] == key else None

    def close(self, wait: float) -> bool:
        """Start no read from now on; wait up to `wait` seconds for the one in flight. Whether none is left."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: not self._busy, timeout=wait)

    def _run(self, key: tuple[int, ...]) -> None:
        result: R | None = None
        try:
            result = self._read(key)
        finally:
            with self._cond:
                self._done, self._busy = (key, result), False
                self._reads += 1
                self._cond.notify_all()
