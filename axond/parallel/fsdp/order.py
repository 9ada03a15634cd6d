"""The order FSDP's units ran in, so each one can prefetch the unit that ran after it last time."""

from __future__ import annotations

from axond.parallel.fsdp.unit import FSDPUnit


class RunOrder:
    """The order units ran in during the last forward (or backward), to prefetch the next one during this one.

    Every rank runs the same hooks in the same order, so every rank prefetches the same units and
    the collectives stay matched. A unit that runs twice is looked up by its first run.
    """

    def __init__(self) -> None:
        self._next: dict[int, FSDPUnit] = {}
        self._now: list[FSDPUnit] = []

    def start(self) -> None:
        self._now = []

    def saw(self, unit: FSDPUnit) -> FSDPUnit | None:
        """Record that `unit` runs now; return the unit that ran after it last time (None if none)."""
        self._now.append(unit)
        return self._next.get(id(unit))

    def end(self) -> None:
        nxt: dict[int, FSDPUnit] = {}
        for a, b in zip(self._now, self._now[1:]):
            nxt.setdefault(id(a), b)
        self._next = nxt
