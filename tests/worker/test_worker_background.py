"""The worker's monitor loop never waits on a store read: `Background` returns at once when the read hangs."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from axond.worker.background import Background


def test_a_quick_read_is_returned_fresh() -> None:
    calls: list[tuple[int, ...]] = []

    def read(ranks: Sequence[int]) -> dict[int, int]:
        calls.append(tuple(ranks))
        return {r: len(calls) for r in ranks}

    reads = Background(read, "test-read", wait_s=5.0)
    assert reads([0, 1]) == {0: 1, 1: 1}
    assert reads([0, 1]) == {0: 2, 1: 2}


def test_a_hung_read_costs_the_caller_only_its_wait_and_runs_once() -> None:
    release = threading.Event()
    started: list[float] = []

    def read(ranks: Sequence[int]) -> dict[int, int]:
        started.append(time.monotonic())
        assert release.wait(30), "the test never released the read"
        return {r: 7 for r in ranks}

    reads = Background(read, "test-read", wait_s=0.05)
    for _ in range(5):  # while the read hangs: nothing to return, and no second read in flight
        begun = time.monotonic()
        assert reads([3]) is None
        assert time.monotonic() - begun < 5.0  # the call waited its 0.05 s, not the read (bound: a busy machine)
    assert len(started) == 1
    release.set()
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        got = reads([3])
        time.sleep(0.01)
    assert got == {3: 7}
    assert reads([4]) in (None, {4: 7})  # another set of ranks never gets the first set's result
