"""Live recovery's watcher (`axond.distributed.live_watch`): a collective blocked on a peer that never answers (its
link cut: no EOF will come) ends as soon as the worker's note names a later generation, as `MembershipChanged`.

Real tcp groups over loopback in threads; the silent rank keeps its sockets open and sends nothing, which is what a
survivor sees of a host whose frames are dropped. The note is written as the worker writes it (`axond.worker.live`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from axond.distributed import live_watch, membership
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.errors import MembershipChanged
from axond.testing import run_threads
from axond.worker.live import announce

GROUP_TIMEOUT_S = 20.0
"""The group's timeout: without the watcher the blocked ranks would wait this long."""
WORDS_AFTER_S = 0.3
"""When the test writes the worker's note, after the ranks entered their collective."""


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "membership-local0.json"
    membership.configure(str(path), 1, 5.0)
    try:
        yield path
    finally:
        membership.configure(None, 0, 0.0)


def test_a_collective_blocked_on_a_silent_peer_raises_membership_changed_at_the_workers_word(live: Path) -> None:
    live_watch.start()
    release = threading.Event()
    written: list[float] = []

    def word() -> None:
        time.sleep(WORDS_AFTER_S)
        written.append(time.monotonic())
        announce([str(live)], 2, "node n2 (host-c) missed 5 heartbeats (1.0 s); re-forming live with the 2 other "
                                 "node(s)")

    def body(g: ProcessGroup) -> tuple[MembershipChanged, float] | None:
        if g.rank == 2:  # cut off: its sockets stay open, nothing comes from it
            release.wait(GROUP_TIMEOUT_S)
            return None
        try:
            g.all_reduce(np.ones(1024, np.float32))
        except MembershipChanged as e:
            return e, time.monotonic()
        finally:
            if g.rank == 0:
                release.set()
        raise AssertionError("the all_reduce with a silent peer completed")

    threading.Thread(target=word, daemon=True).start()
    results = run_threads(body, 3, GROUP_TIMEOUT_S + 10, options=BackendOptions(timeout=GROUP_TIMEOUT_S))
    for caught in results[:2]:
        assert caught is not None
        error, at = caught
        assert error.generation == 2 and error.previous_generation == 1
        assert "node n2 (host-c) missed 5 heartbeats" in error.reason and error.op == "all_reduce"
        assert written[0] <= at < written[0] + GROUP_TIMEOUT_S / 2  # at the word, not at the group's timeout


def test_the_generation_reform_moved_to_is_not_interrupted(live: Path) -> None:
    state = membership.current()
    assert state is not None
    announce([str(live)], 2, "a node left")
    assert state.end(2)  # what reform() does before it forms the new group
    assert not live_watch.check(state)  # the watcher then leaves that group alone
    state.adopt(membership.Note(2, "a node left", True))
    announce([str(live)], 3, "another node left")
    assert live_watch.check(state)  # a later generation: interrupted once
    assert not live_watch.check(state)
