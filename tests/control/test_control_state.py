"""Leases and generations through coordinator stalls and lost nodes: the state machine with explicit time,
and the server's stall detector on a real coordinator."""

from __future__ import annotations

import time
from collections.abc import Callable

from axond.control.client import connect
from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.membership import Health
from axond.coordinator.server import RunningCoordinator
from axond.coordinator.state.machine import CoordinatorState
from axond.testing.waits import wait_until
from axond.v1 import coordinator_pb2 as pb


def two_node_job(max_restarts: int) -> tuple[CoordinatorState, str, str]:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=0.0)
    a, b = (state.register_node(h, 0, False, 0.0).node_id for h in ("a", "b"))
    for n in (a, b):
        state.join("j", n, 1, 2, 2, max_restarts, now=0.0)
    assert state.jobs["j"].state is JobState.RUNNING
    return state, a, b


def test_a_restarting_job_whose_every_node_is_lost_fails_with_the_reason() -> None:
    state, a, b = two_node_job(max_restarts=3)
    state.heartbeat(a, "j", 1, now=2.0)
    state.tick(3.5)  # b silent for 3 intervals: generation 2 opens, a is to re-join it
    j = state.jobs["j"]
    assert j.state is JobState.RESTARTING and j.generation == 2
    state.tick(5.5)  # a, which never re-joined, is lost too: nothing is left to restart the job
    assert j.state is JobState.FAILED, (j.state, j.reason)
    assert "no node left" in j.reason and a in j.reason, j.reason


def test_a_restarting_job_keeps_waiting_while_a_live_node_will_rejoin() -> None:
    state, a, b = two_node_job(max_restarts=3)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        state.heartbeat(a, "j", 1, now=t)
        state.tick(t + 0.01)
    j = state.jobs["j"]
    assert j.state is JobState.RESTARTING and j.generation == 2, (j.state, j.reason)
    assert state.join("j", a, 1, 2, 2, 3, now=5.1) is None  # in the round of generation 2, waiting for a second node


def test_rearmed_leases_do_not_count_the_time_the_coordinator_was_away() -> None:
    state, a, b = two_node_job(max_restarts=0)
    state.heartbeat(a, "j", 1, now=1.0)
    state.heartbeat(b, "j", 1, now=1.5)
    assert state.rearm_leases(10.0, now=12.0) == 2  # stopped from 2.0 to 12.0
    state.tick(12.5)
    assert state.jobs["j"].state is JobState.RUNNING
    # A heartbeat answered right after the stall (queued during it) renews nothing: b is lost a lease after it.
    state.heartbeat(b, "j", 1, now=12.1, renew=False)
    state.heartbeat(a, "j", 1, now=13.0)
    state.tick(14.6)
    j = state.jobs["j"]
    assert state.members.health(state.members.nodes[b], 14.6) is Health.DEAD
    assert j.state is JobState.FAILED and b in j.reason, (j.state, j.reason)


def test_the_server_rearms_leases_after_it_was_stalled(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    """A stall of the serving thread (here: the state's lock held for 3 leases, as a stopped process would) is
    detected by the tick loop; no node is declared dead for it."""
    interval, missed = 0.1, 5
    running = coordinator_factory(heartbeat_interval=interval, dead_after_missed=missed)
    lease = interval * missed
    with connect(running.address, call_timeout=5.0) as client:
        node = client.register_node("h").node_id
        client.join("j", node, 1, 1, 1, timeout=5.0)
        client.heartbeat(node, job="j", generation=1)
        assert running.stalls is not None
        with running.state.lock:
            time.sleep(3 * lease)
        stalls = running.stalls
        wait_until(lambda: stalls.stalls >= 1, 10 * lease, "the stall detector to notice the stall")
        client.heartbeat(node, job="j", generation=1)
        status = client.get_status()
        # Not declared dead for the stall: its job (no restarts) still runs its first generation.
        assert [(j.state, j.generation) for j in status.jobs] == [(pb.JOB_STATE_RUNNING, 1)], status


def test_status_shows_each_job_its_own_pids_and_none_once_finished() -> None:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=0.0)
    node = state.register_node("a", 2, True, 0.0).node_id
    for job in ("first", "second", "third"):
        assert state.join(job, node, 2, 1, 1, 0, now=0.0) is not None
    state.heartbeat(node, "first", 1, now=0.1, local_pids=(11, 12))
    state.heartbeat(node, "second", 1, now=0.2, local_pids=(21, 22))
    state.report_exit("first", node, 1, 0, now=0.3)
    state.heartbeat(node, "third", 1, now=0.4, local_pids=(31, 32))

    def pids(now: float) -> dict[str, list[int]]:
        return {j.job: [r.pid for r in j.ranks] for j in state.status("", now, all=True).jobs}

    assert pids(0.5) == {"first": [0, 0], "second": [21, 22], "third": [31, 32]}
    state.report_exit("second", node, 1, 0, now=0.6)
    state.report_exit("third", node, 1, 3, now=0.7)
    # a finished job, failed or not, keeps its generation and lists its ranks, without pids
    assert pids(0.8) == {"first": [0, 0], "second": [0, 0], "third": [0, 0]}
