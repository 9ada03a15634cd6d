"""Timeouts say what the silent peer is doing: the in-flight reports of `axond.distributed.diagnostics.inflight`.

Ranks are threads over real loopback sockets sharing one store; the reporter thread publishes for real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond
from axond import DistributedError, InMemoryStore, ProcessGroup
from axond.control.client import connect
from axond.distributed.diagnostics.inflight import KEY, REPORTER, describe, describe_others, report_after
from axond.distributed.diagnostics.monitored_barrier import PREFIX
from axond.testing import run_on, run_processes
from axond.testing.waits import wait_until

MakeGroups = Callable[..., list[ProcessGroup]]

REPORT_WAIT = 10 * report_after(0.4) + 2.0
"""Seconds to wait for a report of the groups below (timeout 0.4 s): published report_after(0.4) into a slow op and
looked at every half of that, so it normally takes 0.1-0.15 s; the rest is room for a busy machine."""


def test_a_cross_group_deadlock_names_the_op_and_group_of_each_side(make_groups: MakeGroups) -> None:
    pair = make_groups(2, 1.2)
    subs = run_on(pair, lambda g: g.new_group([0, 1]))

    def body(g: ProcessGroup) -> None:
        if g.rank == 0:
            g.all_reduce(np.ones(4, np.float32))
        else:
            time.sleep(0.3)  # enter later, so that rank 0 times out first, while rank 1 still waits
            subs[1].broadcast(np.ones(4, np.float32), 0)

    out = run_on(pair, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert "all_reduce on group 'world' (rank 0 of 2): timed out after 1.2 s waiting for peer 1; " in str(out[0])
    assert "peer rank 1 (pid " in str(out[0])
    assert f"is blocked in broadcast on group '{subs[1].name}' for " in str(out[0])
    assert "not in all_reduce on group 'world': the ranks issued their ops in different orders" in str(out[0])
    assert f"broadcast on group '{subs[1].name}' (rank 1 of 2): timed out after 1.2 s waiting for peer 0; " in str(out[1])
    for s in subs:
        s.destroy()


def _deadlock_across_groups() -> str:
    sub = axond.new_group([0, 1])
    try:
        if axond.get_rank() == 0:
            axond.all_reduce(np.ones(3))
        else:
            time.sleep(0.5)  # rank 0 times out first; when it then closes its groups, rank 1 sees that
            sub.broadcast(np.ones(3), 0)
    except DistributedError as e:
        return str(e)
    finally:
        sub.destroy()
    return "no error"


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_processes_report_through_the_coordinator_store(coordinator_factory) -> None:  # type: ignore[no-untyped-def]
    # The test's node does not heartbeat: a long dead-after keeps it alive while the ranks start.
    coordinator = coordinator_factory(dead_after_missed=120)
    client = connect(coordinator.address, call_timeout=5.0)
    node = client.register_node("h").node_id
    gen = client.join("inflight", node, 1, 1, 2, 0, timeout=5.0).generation
    env = {"AXOND_COORDINATOR": coordinator.address, "AXOND_JOB": "inflight", "AXOND_GENERATION": str(gen),
           "AXOND_JOB_SECRET": "cd" * 16}
    try:
        got = run_processes(_deadlock_across_groups, 2, timeout=60.0, op_timeout=2.0, env=env)
    finally:
        client.close()
    assert "all_reduce on group 'world' (rank 0 of 2): timed out after 2.0 s waiting for peer 1; " in got[0]
    assert "is blocked in broadcast on group 'world/1[0,1]' for " in got[0], got[0]
    assert got[1].startswith("broadcast on group 'world/1[0,1]' (rank 1 of 2): "), got[1]


def test_a_peer_outside_any_op_is_reported_as_such(make_groups: MakeGroups) -> None:
    pair = make_groups(2, 1.2)
    gave_up = threading.Event()

    def body(g: ProcessGroup) -> None:
        if g.rank == 0:
            try:
                g.all_reduce(np.ones(4, np.float32))
            finally:
                gave_up.set()
        else:  # "computing": never enters the all_reduce before rank 0 gives up
            assert gave_up.wait(30.0), "rank 0 never gave up"

    out = run_on(pair, body, return_exceptions=True)
    assert isinstance(out[0], DistributedError) and out[1] is None
    assert "waiting for peer 1; peer rank 1 reports no op blocked for over 0.3 s: it is outside axond" in str(out[0])


def test_reports_are_json_cover_only_slow_ops_and_clear_when_they_finish() -> None:
    store = InMemoryStore()

    class Group:
        name, timeout, inflight, inflight_seq = "g", 0.4, None, 0

    g: Any = Group()
    REPORTER.register(store, 7, g)
    try:
        g.inflight, g.inflight_seq = "all_gather", 1
        started = time.monotonic()
        time.sleep(report_after(0.4) / 2)
        assert store.try_get(KEY.format(7)) is None  # not slow yet: nothing published
        wait_until(lambda: store.try_get(KEY.format(7)) is not None, REPORT_WAIT, "the report of the slow op")
        assert time.monotonic() - started >= report_after(0.4), "published before the op was slow"
        report = json.loads(store.try_get(KEY.format(7)) or b"{}")
        assert [(o["group"], o["op"]) for o in report["ops"]] == [("g", "all_gather")]
        assert "blocked in all_gather on group 'g'" in describe(store, 7, 3, 0.4)
        assert describe(store, 7, 3, 0.4).startswith("peer rank 3 (global rank 7) (pid ")
        g.inflight = None
        wait_until(lambda: json.loads(store.try_get(KEY.format(7)) or b"{}")["ops"] == [], REPORT_WAIT,
                   "the report of no op blocked")
        assert "reports no op blocked" in describe(store, 7, 7, 0.4)
    finally:
        REPORTER.unregister(store, 7, g)


def test_a_store_that_fails_only_loses_the_report() -> None:
    class Broken(InMemoryStore):
        def set(self, key: str, value: bytes) -> None:
            raise OSError("store down")

        def try_get(self, key: str) -> bytes | None:
            raise OSError("store down")

    store = Broken()

    class Group:
        name, timeout, inflight, inflight_seq = "g", 0.4, "barrier", 1

    g: Any = Group()
    good = InMemoryStore()
    other: Any = Group()
    REPORTER.register(store, 0, g)
    try:
        time.sleep(0.3)
        assert "could not be asked" in describe(store, 1, 1, 0.4)
        good.set(KEY.format(5), b'{"ops": [{"group": 1}]}')
        assert describe(good, 5, 5, 0.4) == "peer rank 5 published an unreadable report"
        REPORTER.register(good, 1, other)  # the reporter survived the failures: it still publishes for others
        wait_until(lambda: "blocked in barrier on group 'g'" in describe(good, 1, 1, 0.4), REPORT_WAIT,
                   "the reporter to publish to the working store")
    finally:
        REPORTER.unregister(store, 0, g)
        REPORTER.unregister(good, 1, other)


def test_monitored_barrier_passes_when_everyone_comes(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 1.2)
    def body(g: ProcessGroup) -> int:
        for _ in range(3):
            g.monitored_barrier(timeout=5.0)
        axond.monitored_barrier(g, wait_all_ranks=True)
        return g.rank

    assert run_on(gs, body) == [0, 1, 2]
    store = gs[0]._store
    assert store is not None
    verdicts = [store.try_get(PREFIX.format(group="world", seq=k) + "released") for k in range(1, 5)]
    assert verdicts == [None, None, None, b"ok"]  # the store keeps the last verdict only, and no arrivals
    assert all(store.try_get(PREFIX.format(group="world", seq=4) + f"arrived/{r}") is None for r in (1, 2))


@pytest.mark.slow  # many rank processes or deadlines waited out: the full run, not the quick loop
def test_monitored_barrier_names_every_missing_rank_and_what_it_does(make_groups: MakeGroups) -> None:
    """Ranks 0 and 1 reach the barrier; rank 2 computes; rank 3 waits in an all_reduce on a subgroup with rank 2."""
    gs = make_groups(4, 2.0)
    subs = run_on(gs, lambda g: g.new_group([2, 3]))
    left = [threading.Event(), threading.Event()]

    def body(g: ProcessGroup) -> None:
        if g.rank < 2:
            try:
                g.monitored_barrier(timeout=1.5, wait_all_ranks=True)
            finally:
                left[g.rank].set()
        elif g.rank == 2:
            for done in left:  # "computing" until the barrier's members have given up on it
                assert done.wait(30.0), "the barrier never ended"
        else:
            subs[3].all_reduce(np.ones(2))

    try:
        out = run_on(gs, body, return_exceptions=True)
    finally:
        for s in subs:
            s.destroy()
    assert isinstance(out[0], DistributedError) and isinstance(out[1], DistributedError), out
    msg = str(out[0])
    assert msg.startswith("monitored_barrier on group 'world' (rank 0 of 4): ranks [2, 3] did not reach it within 1.5 s; ")
    assert "peer rank 2 reports no op blocked" in msg
    assert "peer rank 3 (pid " in msg and f"is blocked in all_reduce on group '{subs[3].name}' for " in msg
    assert "not in monitored_barrier on group 'world'" in msg
    assert out[0].op == "monitored_barrier" and out[0].peer == 2
    assert str(out[1]).startswith("monitored_barrier on group 'world' (rank 1 of 4): rank 0 gave up: ranks [2, 3] ")
    assert out[2] is None and isinstance(out[3], DistributedError)


def test_monitored_barrier_without_wait_all_ranks_names_the_first_and_says_how_to_see_all(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 1.2)
    left = {0: threading.Event(), 2: threading.Event()}

    def body(g: ProcessGroup) -> None:
        if g.rank == 1:
            for done in left.values():  # away until the others have given up on the barrier
                assert done.wait(30.0), "the barrier never ended"
            return
        try:
            g.monitored_barrier(timeout=0.5)
        finally:
            left[g.rank].set()

    with pytest.raises(ValueError, match="timeout must be positive"):
        gs[0].monitored_barrier(timeout=0)
    out = run_on(gs, body, return_exceptions=True)
    assert "rank 1 did not reach it within 0.5 s (wait_all_ranks=True names every missing rank); peer rank 1 " in str(out[0])
    assert "rank 0 gave up: rank 1 did not reach it" in str(out[2])


def test_describe_others_names_the_members_not_in_the_op_and_counts_the_rest() -> None:
    """What an NCCL collective's timeout appends: its timeout names no peer, so every member is asked."""
    store = InMemoryStore()

    class Group:
        timeout, inflight_seq = 0.4, 1

        def __init__(self, name: str, op: str | None) -> None:
            self.name, self.inflight = name, op

    members: list[Any] = [Group("g", "all_reduce"), Group("g", "all_reduce"), Group("g/sub", "broadcast"), None]
    for rank, g in enumerate(members):
        if g is not None:
            REPORTER.register(store, 10 + rank, g)
    try:
        wait_until(lambda: all(store.try_get(KEY.format(r)) is not None for r in (10, 11, 12)), REPORT_WAIT,
                   "the reports of ranks 0-2")
        text = describe_others(store, [10, 11, 12, 13], 0, 0.4, ("g", "all_reduce"))
        parts = text.split("; ")
        assert parts[0].startswith("peer rank 2 (global rank 12) (pid ")
        assert "is blocked in broadcast on group 'g/sub' for " in parts[0]
        assert parts[0].endswith("not in all_reduce on group 'g': the ranks issued their ops in different orders")
        assert parts[1].startswith("peer rank 3 (global rank 13) reports no op blocked")
        assert parts[-1] == "1 other peer is blocked in it too"
        members[2].inflight, members[2].name = "all_reduce", "g"
        members[3] = Group("g", "all_reduce")
        REPORTER.register(store, 13, members[3])
        agreed = ("every peer asked (3) is blocked in all_reduce on group 'g' too: the ranks agree on the op, "
                  "which itself stalls (a device, driver or network hang)")
        wait_until(lambda: describe_others(store, [10, 11, 12, 13], 0, 0.4, ("g", "all_reduce")) == agreed,
                   REPORT_WAIT, "every peer's report of the all_reduce")
    finally:
        for rank, g in enumerate(members):
            if g is not None:
                REPORTER.unregister(store, 10 + rank, g)


def test_a_group_describes_its_members_while_they_wait_in_a_real_op(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 2.0)
    seen: list[str] = []

    def body(g: ProcessGroup) -> None:
        if g.rank == 2:  # away until the others, waiting in the all_reduce, have reported it
            wait_until(lambda: gs[0]._describe_peers("all_reduce").endswith("; 1 other peer is blocked in it too"),
                       10 * report_after(2.0) + 2.0, "rank 1's report of the all_reduce")
            seen.append(gs[0]._describe_peers("all_reduce"))
        g.all_reduce(np.ones(3))

    run_on(gs, body)
    assert seen[0].startswith("peer rank 2 reports no op blocked for over 0.5 s")
    assert seen[0].endswith("; 1 other peer is blocked in it too")


def test_describe_others_stops_asking_a_store_that_does_not_answer() -> None:
    class Down(InMemoryStore):
        reads = 0

        def try_get(self, key: str) -> bytes | None:
            Down.reads += 1
            raise OSError("store down")

    text = describe_others(Down(), [0, 1, 2, 3], 0, 0.4, ("g", "all_reduce"))
    assert text == ("peer rank 1 could not be asked what it is doing (the store did not answer) (2 more not asked)")
    assert Down.reads == 1


def test_the_job_report_follows_a_process_that_live_recovery_moved_into_a_later_generation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A rank kept running into the next generation (live recovery) publishes its reports and arrival marks there,
    under its new rank, with its first mark in that generation: the coordinator's goodput book counts the generation
    productive from when its ranks run (it looked for them in vain, and called the rest of the job re-formation)."""
    from axond.distributed.diagnostics.inflight import _Reporter

    for var, value in (("AXOND_COORDINATOR", "127.0.0.1:1"), ("AXOND_JOB", "live"), ("AXOND_GENERATION", "1"),
                       ("RANK", "2"), ("WORLD_SIZE", "3"), ("AXOND_JOB_SECRET", "cd" * 16)):
        monkeypatch.setenv(var, value)
    reporter = _Reporter()
    first = reporter._job_sink()
    assert first.active and reporter._env is not None and (reporter._env.generation, reporter._env.rank) == (1, 2)
    reporter._started = 1.0
    assert reporter._job_sink() is first  # read once while the generation stays
    monkeypatch.setenv("AXOND_GENERATION", "2")  # what `axond.reform()` sets, with the new rank
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    second = reporter._job_sink()
    assert second is not first and (reporter._env.generation, reporter._env.rank) == (2, 1)
    assert second._key == KEY.format(1) and reporter._started is None
