"""Live recovery's growth in the state machine (plain, explicit time): a node that joins a running live job below its
MAX opens the next generation with the running nodes and itself, marked live (the running ranks keep their processes),
freezing as soon as they all joined, and no restart is counted."""

from __future__ import annotations

import pytest

from axond.coordinator.state.errors import FailedPrecondition
from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.machine import CoordinatorState

SETTLE = 5.0
"""A long settle time: a round that froze before it passed froze because every expected node joined."""


def shrunk_job(max_restarts: int = 0) -> tuple[CoordinatorState, list[str]]:
    """A 2:3 live job that lost its third node (c) and re-formed live with a and b as generation 2 (with restarts
    left, c's worker is waited for until the settle time: it did not come)."""
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    ids = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(3)]
    for n in ids:
        state.join("j", n, 1, 2, 3, max_restarts, now=0.0, live=True)
    a, b, c = ids
    state.report_failure("j", c, 1, 2, 137, "rank 2 exited with code 137 (SIGKILL)", now=1.0)
    state.join("j", a, 1, 2, 3, max_restarts, now=1.1, live=True)
    got = state.join("j", b, 1, 2, 3, max_restarts, now=1.1, live=True)
    if max_restarts:
        assert got is None  # c may re-join as its own replacement: waited for
        for t in (2.0, 3.0, 4.0, 5.0, 6.0):  # the running nodes keep their leases
            state.heartbeat(a, "j", 2, now=t)
            state.heartbeat(b, "j", 2, now=t)
        now = 1.1 + SETTLE
        while (deadline := state.tick(now)) is not None and not state.jobs["j"].round.frozen and now < 30:
            now = max(now, deadline)  # c, silent since, is declared dead: the round freezes once its fence passed
        got = state.join_result("j", b, now=now)
    assert got is not None and got.world_size == 2
    return state, ids


def test_a_failed_nodes_worker_with_restarts_left_is_waited_for_in_the_re_formation() -> None:
    """Its worker reported the failure and re-joins as a replacement: the next generation freezes once it joined too
    (its new rank offers the lost rank's shards from that worker's memory), counting one restart."""
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    a, b, c = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(3)]
    for n in (a, b, c):
        state.join("j", n, 1, 2, 3, 1, now=0.0, live=True)
    j = state.jobs["j"]
    state.report_failure("j", c, 1, 2, 137, "rank 2 exited with code 137 (SIGKILL)", now=1.0)
    assert state.left_job("j", c) and j.generation == 2
    assert state.join("j", a, 1, 2, 3, 1, now=1.1, live=True) is None
    assert state.join("j", b, 1, 2, 3, 1, now=1.1, live=True) is None  # not frozen: c is expected
    got = state.join("j", c, 1, 2, 3, 1, now=1.2, live=True)  # long before the settle time
    assert got is not None and (got.generation, got.world_size) == (2, 3) and j.restarts == 1
    assert not state.left_job("j", c)


def test_a_new_node_joins_a_running_live_job_beside_its_running_ranks() -> None:
    state, (a, b, _) = shrunk_job()
    j = state.jobs["j"]
    d = state.register_node("h9", 0, False, 2.0).node_id
    assert state.join("j", d, 1, 2, 3, 0, now=2.0, live=True) is None
    assert (j.generation, j.restarts) == (3, 0)
    beat = state.heartbeat(a, "j", 2, now=2.1)  # the running nodes hear of it as a live move: they keep their ranks
    assert beat.live and beat.generation == 3 and f"node {d}" in beat.reason and "joined" in beat.reason
    assert state.join("j", a, 1, 2, 3, 0, now=2.2, live=True) is None  # b not yet
    got = state.join("j", b, 1, 2, 3, 0, now=2.3, live=True)  # frozen at once, long before the settle time
    assert got is not None and (got.generation, got.world_size) == (3, 3)
    new = state.join_result("j", d, now=2.3)
    assert new is not None and new.rank_offset == 2 and new.restarts_left == 0  # "h9" sorts after "h0" and "h1"
    for n in (a, b, d):
        state.report_exit("j", n, 3, 0, now=3.0)
    assert j.state is JobState.SUCCEEDED and j.restarts == 0


def test_the_node_live_recovery_went_on_without_joins_again_for_one_restart() -> None:
    state, (a, b, c) = shrunk_job(max_restarts=1)
    j = state.jobs["j"]
    assert state.left_job("j", c)
    assert state.join("j", c, 1, 2, 3, 1, now=2.0, live=True) is None
    assert not state.left_job("j", c) and j.generation == 3 and j.restarts == 1 and "again" in j.reason
    state.join("j", a, 1, 2, 3, 1, now=2.1, live=True)
    state.join("j", b, 1, 2, 3, 1, now=2.1, live=True)
    assert j.round.frozen and j.round.world_size == 3


def test_without_restarts_left_the_node_that_left_is_refused_and_the_job_goes_on() -> None:
    state, (a, b, c) = shrunk_job()
    j = state.jobs["j"]
    with pytest.raises(FailedPrecondition, match="no restarts left"):
        state.join("j", c, 1, 2, 3, 0, now=2.0, live=True)
    assert state.left_job("j", c) and j.generation == 2 and j.state is JobState.RUNNING and j.restarts == 0


def test_a_full_live_job_refuses_one_more_node() -> None:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    ids = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(3)]
    for n in ids[:2]:
        state.join("j", n, 1, 1, 2, 0, now=0.0, live=True)
    with pytest.raises(FailedPrecondition, match="all its 2 node"):
        state.join("j", ids[2], 1, 1, 2, 0, now=0.1, live=True)


def test_a_newcomer_lost_before_the_freeze_leaves_the_running_nodes_to_freeze_alone() -> None:
    state, (a, b, _) = shrunk_job()
    j = state.jobs["j"]
    d = state.register_node("h9", 0, False, 2.0).node_id
    state.join("j", d, 1, 2, 3, 0, now=2.0, live=True)
    state.leave_rendezvous("j", d)
    state.join("j", a, 1, 2, 3, 0, now=2.2, live=True)
    state.join("j", b, 1, 2, 3, 0, now=2.2, live=True)
    for t in range(3, 8):  # the running nodes keep their leases
        state.heartbeat(a, "j", 2, now=float(t))
        state.heartbeat(b, "j", 2, now=float(t))
    assert not j.round.frozen
    state.tick(2.2 + SETTLE)  # d is no longer awaited: the settle time, then the two running nodes alone
    assert j.round.frozen and j.round.world_size == 2 and j.restarts == 0
