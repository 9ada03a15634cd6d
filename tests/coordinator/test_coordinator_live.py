"""Live recovery in the state machine (plain, explicit time): a failed node's generation is replaced by one of the
survivors, who re-join at once, without a restart counted; too few survivors restart as before."""

from __future__ import annotations

import pytest

from axond.coordinator.state.errors import FailedPrecondition, InvalidArgument
from axond.coordinator.state.jobs import EventLog, JobSpec, JobState
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.state.records import job_from, job_record

SETTLE = 5.0
"""A long settle time: a live round that froze before it passed froze because every survivor joined."""


def live_job(nodes: int, min_nodes: int, live: bool = True) -> tuple[CoordinatorState, list[str]]:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    ids = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(nodes)]
    for n in ids:
        state.join("j", n, 1, min_nodes, nodes, 0, now=0.0, live=live)
    assert state.jobs["j"].state is JobState.RUNNING
    return state, ids


def test_a_failed_rank_re_forms_live_with_the_survivors_without_a_restart() -> None:
    state, (a, b, c) = live_job(3, 2)
    generation, will = state.report_failure("j", c, 1, 2, 137, "rank 2 exited with code 137 (SIGKILL)", now=1.0)
    j = state.jobs["j"]
    assert (generation, will, j.generation, j.restarts) == (2, True, 2, 0)
    assert state.left_job("j", c) and not state.left_job("j", a)
    beat = state.heartbeat(a, "j", 1, now=1.1)
    assert beat.live and beat.generation == 2 and "rank 2" in beat.reason and "re-forming live" in beat.reason
    assert state.join("j", a, 1, 2, 3, 0, now=1.2, live=True) is None  # b not yet: the survivors are awaited
    got = state.join("j", b, 1, 2, 3, 0, now=1.3, live=True)  # well before the settle time: nobody else is awaited
    assert got is not None and (got.generation, got.world_size, got.rank_offset) == (2, 2, 1)
    assert state.join_result("j", a, now=1.3) is not None
    for n in (a, b):
        state.report_exit("j", n, 2, 0, now=2.0)
    assert j.state is JobState.SUCCEEDED


def test_a_lost_node_re_forms_live_only_after_its_fence() -> None:
    state, (a, b, c) = live_job(3, 2)
    for t in (1.0, 2.0, 3.0):
        state.heartbeat(a, "j", 1, now=t)
        state.heartbeat(b, "j", 1, now=t)
    state.tick(3.5)  # c silent for 3 intervals: declared dead
    j = state.jobs["j"]
    assert j.generation == 2 and j.restarts == 0 and state.heartbeat(a, "j", 1, now=3.6).live
    state.join("j", a, 1, 2, 3, 0, now=3.7, live=True)
    state.join("j", b, 1, 2, 3, 0, now=3.7, live=True)
    assert not j.round.frozen  # the dead node's worker may still be killing its ranks: the fence holds
    fence = j.round.not_before
    assert fence > 3.7
    state.tick(fence)
    assert j.round.frozen and j.round.world_size == 2


def test_too_few_survivors_restart_as_before() -> None:
    state, (a, b) = live_job(2, 2)
    generation, will = state.report_failure("j", b, 1, 1, 1, "boom", now=1.0)
    j = state.jobs["j"]
    assert (generation, will) == (1, False) and j.state is JobState.FAILED  # no restarts left: not absorbed either
    assert not state.left_job("j", b)


def test_a_job_without_live_recovery_restarts_every_node() -> None:
    state, (a, b, c) = live_job(3, 2, live=False)
    state.report_failure("j", c, 1, 2, 137, "killed", now=1.0)
    assert state.jobs["j"].state is JobState.FAILED  # max_restarts 0: the failure ends the job
    assert not state.heartbeat(a, "j", 1, now=1.1).live


def test_every_worker_of_a_job_agrees_on_live_recovery() -> None:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    a, b = (state.register_node(h, 0, False, 0.0).node_id for h in ("a", "b"))
    state.join("j", a, 1, 2, 2, 0, now=0.0, live=True)
    with pytest.raises(FailedPrecondition, match="--live-recovery"):
        state.join("j", b, 1, 2, 2, 0, now=0.0, live=False)


def test_a_live_job_keeps_what_it_went_on_without_across_a_coordinator_restart() -> None:
    state, (a, b, c) = live_job(3, 2)
    state.report_failure("j", c, 1, 2, 137, "killed", now=1.0)
    j = state.jobs["j"]
    record = dict(job_record(j, 2.0), past_generations=[])  # past rounds are records of their own
    again = job_from(record, 2.0, EventLog())
    assert (again.live, again.live_generation, again.left) == (True, 2, [c])
    old = dict(record)
    for key in ("live", "live_generation", "left"):  # a record written before live recovery existed
        del old[key]
    assert (lambda r: (r.live, r.live_generation, r.left))(job_from(old, 2.0, EventLog())) == (False, 0, [])


def test_a_submitted_job_recovers_live_within_its_node_range_and_keeps_it_across_a_restart() -> None:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    with pytest.raises(InvalidArgument, match="needs live_recovery"):
        state.submit_job("x", JobSpec(3, 1, ("true",), (), 0, "", min_nodes=2), now=0.0)
    with pytest.raises(InvalidArgument, match="above nnodes"):
        state.submit_job("x", JobSpec(3, 1, ("true",), (), 0, "", min_nodes=4, live_recovery=True), now=0.0)
    spec = JobSpec(3, 1, ("python", "train.py"), (), 0, "", min_nodes=2, live_recovery=True)
    name = state.submit_job("sub", spec, now=0.0)
    daemons = [state.register_node(f"d{i}", 1, True, 0.0).node_id for i in range(3)]
    for d in daemons:
        ((got, given),) = state.take_work(d, 0.0)[0]
        assert (got, given.least_nodes, given.live_recovery) == (name, 2, True)
        state.join(name, d, 1, 2, 3, 0, now=0.0, live=True)
    j = state.jobs[name]
    assert (j.min_nodes, j.max_nodes, j.live, j.state) == (2, 3, True, JobState.RUNNING)
    state.report_failure(name, daemons[2], 1, 2, 137, "rank 2 exited with code 137 (SIGKILL)", now=1.0)
    assert (j.generation, j.restarts, j.left) == (2, 0, [daemons[2]])
    assert any("re-forming live as generation 2" in getattr(e, "text", "") for e in j.events.events)
    again = job_from(dict(job_record(j, 2.0), past_generations=[]), 2.0, EventLog())
    assert again.spec == spec
