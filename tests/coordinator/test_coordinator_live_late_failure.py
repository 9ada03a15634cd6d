"""Live recovery in the state machine (plain, explicit time): two nodes' ranks fail at about the same time. The first
report opens the next generation with the others, the second node among them; its report, about the generation
before, arrives once that one is open. The second node has no running ranks to bring: the job goes on without it
too (its worker re-joins as a replacement only with restarts left, counted), never with fresh ranks let into the
generation as if it had restarted (they would meet the survivors mid-recovery, and no restart would be counted)."""

from __future__ import annotations

import pytest

from axond.coordinator.state.errors import FailedPrecondition
from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.machine import CoordinatorState

SETTLE = 5.0
"""A long settle time: a live round that froze before it passed froze because every node it awaited joined."""


def live_job(nodes: int, min_nodes: int, max_restarts: int = 0) -> tuple[CoordinatorState, list[str]]:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=3, settle_time=SETTLE)
    ids = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(nodes)]
    for n in ids:
        state.join("j", n, 1, min_nodes, nodes, max_restarts, now=0.0, live=True)
    assert state.jobs["j"].state is JobState.RUNNING
    return state, ids


def will_restart(state: CoordinatorState, node: str, generation: int, now: float) -> tuple[int, bool]:
    """What the servicer answers a failure report: (generation, will_restart and not left_job)."""
    got, will = state.report_failure("j", node, generation, -1, 137, "rank exited with code 137 (SIGKILL)", now=now)
    return got, will and not state.left_job("j", node)


def test_a_late_report_of_the_generation_before_leaves_its_node_out_of_the_live_one() -> None:
    state, (a, b, c, d) = live_job(4, 2)
    j = state.jobs["j"]
    assert will_restart(state, c, 1, now=1.0) == (2, False)  # c's report: generation 2 awaits a, b and d
    assert j.round.expected == {a, b, d}
    assert will_restart(state, d, 1, now=1.1) == (2, False)  # d's, late: d's worker must not start fresh ranks
    assert state.left_job("j", d) and j.round.expected == {a, b} and j.restarts == 0 and j.generation == 2
    assert state.join("j", a, 1, 2, 4, 0, now=1.2, live=True) is None
    got = state.join("j", b, 1, 2, 4, 0, now=1.3, live=True)  # long before the settle time: nobody else is awaited
    assert got is not None and (got.generation, got.world_size) == (2, 2)
    with pytest.raises(FailedPrecondition, match="no restarts left"):  # --max-restarts 0: d stays out
        state.join("j", d, 1, 2, 4, 0, now=1.4, live=True)
    assert j.state is JobState.RUNNING and j.restarts == 0


def test_with_restarts_left_the_late_node_re_joins_as_a_replacement_for_one_restart() -> None:
    state, (a, b, c, d) = live_job(4, 2, max_restarts=2)
    j = state.jobs["j"]
    will_restart(state, c, 1, now=1.0)
    will_restart(state, d, 1, now=1.1)
    state.join("j", a, 1, 2, 4, 2, now=1.2, live=True)
    assert state.join("j", d, 1, 2, 4, 2, now=1.3, live=True) is None  # counted, then awaited beside a and b
    assert j.restarts == 1 and not state.left_job("j", d)
    state.join("j", b, 1, 2, 4, 2, now=1.4, live=True)
    assert not j.round.frozen  # c reported its own failure with restarts left: its worker is awaited too
    state.join("j", c, 1, 2, 4, 2, now=1.5, live=True)  # all awaited joined: it freezes, c and d new ranks in
    assert j.round.frozen and j.generation == 2 and {m.node_id for m in j.round.members or []} == {a, b, c, d}
    assert j.restarts == 2


def test_a_late_report_leaving_too_few_nodes_restarts_as_before() -> None:
    state, (a, b, c, d, e) = live_job(5, 4, max_restarts=1)
    j = state.jobs["j"]
    will_restart(state, c, 1, now=1.0)  # generation 2 awaits a, b, d, e and c (restarts left: its worker re-joins)
    assert will_restart(state, d, 1, now=1.1) == (2, False) and j.round.expected == {a, b, c, e}  # four: MIN
    assert will_restart(state, e, 1, now=1.2) == (3, True)  # three left: every node restarts, one restart counted
    assert j.restarts == 1 and not state.heartbeat(a, "j", 2, now=1.3).live


def test_a_late_report_without_restarts_to_restart_fails_the_job() -> None:
    state, (a, b, c, d) = live_job(4, 3)
    will_restart(state, c, 1, now=1.0)
    assert will_restart(state, d, 1, now=1.1) == (2, False)
    assert state.jobs["j"].state is JobState.FAILED and "no restarts left" in state.jobs["j"].reason


def test_a_node_declared_dead_while_the_live_generation_awaits_it_is_no_longer_awaited() -> None:
    state, (a, b, c, d) = live_job(4, 2)
    j = state.jobs["j"]
    state.report_failure("j", c, 1, 2, 137, "killed", now=0.5)  # generation 2 awaits a, b and d
    for t in (1.0, 2.0, 3.0):
        for n in (a, b):
            state.heartbeat(n, "j", 1, now=t)
    state.join("j", a, 1, 2, 4, 0, now=3.0, live=True)
    state.join("j", b, 1, 2, 4, 0, now=3.0, live=True)
    state.tick(3.6)  # d silent for 3 intervals: declared dead, its ranks still perhaps running: the fence holds
    assert state.left_job("j", d) and j.round.expected == {a, b} and not j.round.frozen and j.generation == 2
    state.tick(j.round.not_before)  # then it freezes with a and b, not at the settle time
    assert j.round.frozen and j.round.world_size == 2 and j.round.not_before < 0.5 + SETTLE
