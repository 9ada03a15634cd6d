"""The coordinator state machine driven directly, with explicit time: no gRPC."""

from __future__ import annotations

import pytest

from axond.fencing import FENCE_MARGIN_S, fence_wait

from axond.coordinator.state.errors import (
    AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted,
)
from axond.coordinator.state.jobs import FinishedEvent, InfoEvent, JobSpec, JobState, OutputEvent
from axond.coordinator.state.kv_space import MAX_SPACE_BYTES
from axond.coordinator.state.membership import Health
from axond.coordinator.state.machine import CoordinatorState
from axond.store import MAX_VALUE_BYTES


def make(**kw: float) -> tuple[CoordinatorState, list[tuple]]:
    topics: list[tuple] = []
    params = {"heartbeat_interval": 1.0, "dead_after_missed": 3, "settle_time": 0.5, **kw}
    return CoordinatorState(listener=topics.append, **params), topics  # type: ignore[arg-type]


def nodes(state: CoordinatorState, hosts: list[str], now: float = 0.0) -> list[str]:
    return [state.register_node(h, 0, False, now).node_id for h in hosts]


def test_rendezvous_freezes_at_max_with_contiguous_ranks_sorted_by_host() -> None:
    state, topics = make()
    ids = nodes(state, ["c", "a", "b"])
    nproc = {ids[0]: 1, ids[1]: 2, ids[2]: 3}
    results = {}
    for node_id in ids:
        results[node_id] = state.join("j", node_id, nproc[node_id], 3, 3, 0, now=1.0)
    assert results[ids[0]] is None and results[ids[1]] is None
    assert ("job", "j") in topics
    got = {n: state.join_result("j", n, 1.0) for n in ids}
    # hostname order a, b, c: node ranks 0, 1, 2 with rank blocks [0,1], [2,3,4], [5]
    assert [(got[n].node_rank, got[n].rank_offset, got[n].local_world_size) for n in (ids[1], ids[2], ids[0])] == [
        (0, 0, 2), (1, 2, 3), (2, 5, 1)
    ]
    assert {g.world_size for g in got.values()} == {6}
    assert {g.job_secret for g in got.values()} == {got[ids[0]].job_secret}
    assert state.jobs["j"].state is JobState.RUNNING


def test_same_joins_give_same_ranks_in_any_join_order() -> None:
    outcomes = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        state, _ = make()
        ids = nodes(state, ["h1", "h0", "h1", "h0"])
        for i in order:
            state.join("j", ids[i], 2, 4, 4, 0, now=0.0)
        outcomes.append([state.join_result("j", n, 0.0).rank_offset for n in ids])  # type: ignore[union-attr]
    assert outcomes[0] == outcomes[1] == outcomes[2] == [4, 0, 6, 2]


def test_min_max_waits_settle_time_for_late_joiners() -> None:
    state, _ = make(settle_time=0.5)
    a, b, c, d = nodes(state, ["a", "b", "c", "d"])
    assert state.join("j", a, 1, 2, 3, 0, now=10.0) is None
    assert state.join("j", b, 1, 2, 3, 0, now=10.1) is None
    assert state.tick(10.2) == pytest.approx(10.6)
    assert state.join("j", c, 1, 2, 3, 0, now=10.3) is not None
    assert state.join_result("j", a, 10.3).world_size == 3  # type: ignore[union-attr]

    state2, _ = make(settle_time=0.5)
    a, b = nodes(state2, ["a", "b"])
    state2.join("j", a, 1, 2, 3, 0, now=0.0)
    state2.join("j", b, 1, 2, 3, 0, now=0.0)
    assert state2.join_result("j", a, 0.4) is None
    state2.tick(0.6)
    assert state2.join_result("j", a, 0.6).world_size == 2  # type: ignore[union-attr]


def test_late_joiner_after_freeze_with_room_reforms_without_using_a_restart() -> None:
    state, _ = make(settle_time=0.5)
    a, b, c = nodes(state, ["a", "b", "c"])
    state.join("j", a, 1, 2, 3, 1, now=0.0)
    state.join("j", b, 1, 2, 3, 1, now=0.0)
    state.tick(0.5)
    assert state.join_result("j", a, 0.5).world_size == 2  # type: ignore[union-attr]
    assert state.join("j", c, 1, 2, 3, 1, now=1.0) is None
    job = state.jobs["j"]
    assert job.generation == 2 and job.restarts == 0 and "joined" in job.reason
    assert state.heartbeat(a, "j", 1, now=1.0).generation == 2
    state.join("j", a, 1, 2, 3, 1, now=1.1)
    got = state.join("j", b, 1, 2, 3, 1, now=1.2)
    assert got is not None and got.generation == 2 and got.world_size == 3


def test_dead_node_bumps_generation_and_survivors_see_it_in_heartbeats() -> None:
    state, _ = make(heartbeat_interval=1.0, dead_after_missed=3)
    a, b = nodes(state, ["a", "b"])
    state.join("j", a, 1, 2, 2, 1, now=0.0)
    state.join("j", b, 1, 2, 2, 1, now=0.0)
    state.heartbeat(a, "j", 1, now=2.0)
    assert state.status("", 2.0).nodes[1].health is Health.SUSPECT
    state.heartbeat(a, "j", 1, now=3.5)
    state.tick(3.5)
    hb = state.heartbeat(a, "j", 1, now=3.5)
    assert hb.generation == 2 and hb.state is JobState.RESTARTING
    assert b in hb.reason and "missed 3 heartbeats" in hb.reason
    assert state.status("", 3.5).nodes[1].health is Health.DEAD
    state.heartbeat(a, "j", 1, now=6.0)
    state.tick(6.0)
    hb = state.heartbeat(a, "j", 2, now=6.0)
    assert hb.generation == 2, "a dead node outside the frozen generation must not bump again"


def test_report_failure_restarts_then_fails_when_restarts_run_out() -> None:
    state, _ = make()
    a, b = nodes(state, ["a", "b"])
    for gen in (1, 2):
        state.join("j", a, 2, 2, 2, 1, now=0.0)
        got = state.join("j", b, 2, 2, 2, 1, now=0.0)
        assert got is not None and got.generation == gen and got.restarts_left == 2 - gen
        new_gen, will = state.report_failure("j", b, gen, 3, 7, "boom", now=0.0)
        after = gen + 1 if gen == 1 else gen  # the job ends in generation 2 and keeps it
        assert new_gen == after
        assert will is (gen == 1)
        again = state.report_failure("j", a, gen, 0, 9, "same fault", now=0.0)
        assert again == (after, gen == 1), "a second report of the same generation must not bump again"
    job = state.jobs["j"]
    assert job.state is JobState.FAILED and job.exit_code == 7 and "rank 3" in job.reason
    assert isinstance(job.events.events[-1], FinishedEvent)
    with pytest.raises(InvalidArgument, match="rank 4"):
        state2, _ = make()
        x, = nodes(state2, ["x"])
        state2.join("k", x, 4, 1, 1, 0, now=0.0)
        state2.report_failure("k", x, 1, 4, 1, "", now=0.0)


def test_report_exit_succeeds_when_all_exit_zero_and_name_is_reusable() -> None:
    state, _ = make()
    a, b = nodes(state, ["a", "b"])
    state.join("j", a, 1, 2, 2, 0, now=0.0)
    state.join("j", b, 1, 2, 2, 0, now=0.0)
    state.report_exit("j", a, 1, 0, now=1.0)
    assert state.jobs["j"].state is JobState.RUNNING
    state.report_exit("j", b, 1, 0, now=1.0)
    assert state.jobs["j"].state is JobState.SUCCEEDED
    state.join("j", a, 1, 1, 1, 0, now=2.0)
    assert state.jobs["j"].generation == 1 and state.jobs["j"].state is JobState.RUNNING, "a new job starts at 1"


def test_kv_ops_and_generation_scoping() -> None:
    state, topics = make()
    (a,) = nodes(state, ["a"])
    state.join("j", a, 1, 1, 1, 1, now=0.0)
    state.kv_set("j", 1, "k", b"v")
    assert ("key", "j", 1, "k") in topics
    assert state.kv_get("j", 1, "k") == b"v"
    assert state.kv_add("j", 1, "n", 5) == 5 and state.kv_add("j", 1, "n", -2) == 3
    assert state.kv_compare_set("j", 1, "c", None, b"x") == (True, b"x")
    assert state.kv_compare_set("j", 1, "c", b"y", b"z") == (False, b"x")
    assert state.kv_missing("j", 1, ["k", "c", "zz"]) == ["zz"]
    assert state.kv_delete("j", 1, "k") is True and state.kv_delete("j", 1, "k") is False
    with pytest.raises(FailedPrecondition, match="not an integer"):
        state.kv_add("j", 1, "c", 1)
    with pytest.raises(InvalidArgument, match="limit"):
        state.kv_set("j", 1, "big", bytes(MAX_VALUE_BYTES + 1))
    with pytest.raises(InvalidArgument, match="non-empty"):
        state.kv_set("j", 1, "", b"")
    with pytest.raises(InvalidArgument, match="does not exist"):
        state.kv_get("j", 2, "k")
    state.report_failure("j", a, 1, 0, 1, "", now=0.0)
    with pytest.raises(FailedPrecondition, match="is over"):
        state.kv_get("j", 1, "n")
    with pytest.raises(NotFound):
        state.kv_get("nope", 1, "k")


def test_kv_space_limit() -> None:
    state, _ = make()
    (a,) = nodes(state, ["a"])
    state.join("j", a, 1, 1, 1, 0, now=0.0)
    value = bytes(MAX_VALUE_BYTES)
    with pytest.raises(ResourceExhausted):
        for i in range(MAX_SPACE_BYTES // MAX_VALUE_BYTES + 1):
            state.kv_set("j", 1, f"k{i}", value)


def test_barrier_counts_each_arrival_once() -> None:
    state, _ = make()
    (a,) = nodes(state, ["a"])
    state.join("j", a, 1, 1, 1, 0, now=0.0)
    assert state.barrier_arrive("j", 1, "b", 2, "p0") is False
    assert state.barrier_arrive("j", 1, "b", 2, "p0") is False
    assert state.barrier_arrive("j", 1, "b", 2, "p1") is True
    assert state.barrier_done("j", 1, "b")
    with pytest.raises(FailedPrecondition, match="single-use"):
        state.barrier_arrive("j", 1, "b", 2, "p2")
    with pytest.raises(InvalidArgument, match="same size"):
        state.barrier_arrive("j", 1, "b", 3, "p0")


def test_submitted_job_placement_output_and_cancel() -> None:
    state, topics = make()
    spec = JobSpec(nnodes=2, nproc_per_node=2, argv=("python", "x.py"), env=(), max_restarts=0, cwd="")
    name = state.submit_job("", spec, now=0.0)
    assert name == "job-1"
    assert "waiting for 2 worker daemon(s)" in state.jobs[name].events.events[0].text  # type: ignore[union-attr]
    d1 = state.register_node("b", 2, True, 0.0).node_id
    d0 = state.register_node("a", 4, True, 0.0).node_id
    assert ("work", d1) in topics and ("work", d0) in topics
    (work, cancelled) = state.take_work(d0, 0.0)
    assert [w[0] for w in work] == [name] and cancelled == []
    assert state.take_work(d0, 0.0) == ([], []), "assignments are delivered once"
    other = state.register_node("c", 0, False, 0.0).node_id
    with pytest.raises(FailedPrecondition, match="assigned daemons"):
        state.join(name, other, 2, 2, 2, 0, now=0.0)
    with pytest.raises(AlreadyExists):
        state.submit_job(name, spec, now=0.0)
    state.join(name, d0, 2, 2, 2, 0, now=0.0)
    state.join(name, d1, 2, 2, 2, 0, now=0.0)
    state.push_output(name, d0, [(0, "stdout", "hello")])
    events, nxt, skipped, done = state.read_events(name, 0)
    assert OutputEvent(0, "stdout", "hello") in events and not done and skipped == 0
    state.cancel_job(name, now=1.0)
    assert state.take_work(d1, 1.0)[1] == [name]
    events, _, _, done = state.read_events(name, nxt)
    assert done and events[-1] == FinishedEvent(130, "cancelled")
    state.submit_job("second", JobSpec(1, 4, ("true",), (), 0, ""), now=2.0)
    assert [w[0] for w in state.take_work(d0, 2.0)[0]] == ["second"], "slots freed by the cancel are reused"
    assert any(isinstance(e, InfoEvent) and "placed on" in e.text for e in state.jobs["second"].events.events)


def test_bad_input_is_refused_with_domain_errors() -> None:
    state, _ = make()
    (a,) = nodes(state, ["a"])
    with pytest.raises(InvalidArgument, match="MIN must be <= MAX"):
        state.join("j", a, 1, 3, 2, 0, now=0.0)
    with pytest.raises(InvalidArgument, match="nproc"):
        state.join("j", a, 0, 1, 1, 0, now=0.0)
    with pytest.raises(InvalidArgument, match="job"):
        state.join("", a, 1, 1, 1, 0, now=0.0)
    with pytest.raises(NotFound, match="register again"):
        state.heartbeat("n999-x", "", 0, now=0.0)
    with pytest.raises(InvalidArgument, match="slots"):
        state.register_node("h", 0, True, 0.0)
    with pytest.raises(InvalidArgument, match="hostname"):
        state.register_node("", 0, False, 0.0)
    state.join("j", a, 1, 1, 2, 0, now=0.0)
    (b,) = nodes(state, ["b"])
    with pytest.raises(FailedPrecondition, match="same options"):
        state.join("j", b, 1, 1, 3, 0, now=0.0)
    with pytest.raises(InvalidArgument, match="command"):
        state.submit_job("x", JobSpec(1, 1, (), (), 0, ""), now=0.0)


def test_lost_daemon_is_replaced_when_restarts_are_left() -> None:
    state, _ = make(heartbeat_interval=1.0, dead_after_missed=2)
    d0 = state.register_node("a", 1, True, 0.0).node_id
    name = state.submit_job("j", JobSpec(1, 1, ("x",), (), 1, ""), now=0.0)
    assert [w[0] for w in state.take_work(d0, 0.0)[0]] == [name]
    assert state.join(name, d0, 1, 1, 1, 1, now=0.0) is not None
    d1 = state.register_node("b", 1, True, 2.5).node_id
    state.tick(2.5)
    job = state.jobs[name]
    assert job.state is JobState.RESTARTING and job.generation == 2 and job.assigned == [d1]
    assert [w[0] for w in state.take_work(d1, 2.5)[0]] == [name]
    assert state.join(name, d1, 1, 1, 1, 1, now=2.6) is None  # the fence: d0 may still be killing its ranks
    fenced_until = 2.5 + fence_wait(2.0, 1.0, FENCE_MARGIN_S)
    assert state.join(name, d1, 1, 1, 1, 1, now=fenced_until) is not None
    state.tick(10.0)
    assert job.state is JobState.FAILED and "no restarts left" in job.reason


def test_request_ids_answer_retries_once_even_at_the_store_limit_and_stay_bounded() -> None:
    from axond.coordinator.state.kv_space import ANSWERED_PREFIX, MAX_ANSWERED
    from axond.coordinator.limits import CoordinatorLimits

    limit = 256 << 10  # room for MAX_ANSWERED answers (~100 KB) once "fill" is gone
    state, _ = make(limits=CoordinatorLimits(max_store_bytes_per_job=limit))  # type: ignore[arg-type]
    (a,) = nodes(state, ["a"])
    state.join("j", a, 1, 1, 1, 0, now=1.0)
    state.kv_set("j", 1, "fill", b"x" * (limit - len("fill") - len("n") - 2))  # the store is full but for "n"
    assert state.kv_add("j", 1, "n", 7, request_id="r1") == 7  # its kept answer is not refused for space
    assert state.kv_add("j", 1, "n", 7, request_id="r1") == 7, "a retry adds nothing"
    with pytest.raises(ResourceExhausted):
        state.kv_set("j", 1, "more", b"y")
    state.kv_delete("j", 1, "fill")
    for i in range(MAX_ANSWERED + 5):
        state.kv_add("j", 1, "n", 1, request_id=f"id{i}")
    space = state.jobs["j"].kv
    assert sum(k.startswith(ANSWERED_PREFIX) for k in space.data) == MAX_ANSWERED
    assert state.kv_add("j", 1, "n", 1, request_id=f"id{MAX_ANSWERED + 4}") == 7 + MAX_ANSWERED + 5
    with pytest.raises(InvalidArgument, match="request_id"):
        state.kv_add("j", 1, "n", 1, request_id="x" * 65)
