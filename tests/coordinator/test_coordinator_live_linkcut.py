"""Live recovery in the state machine (plain, explicit time): a link cut between nodes that all keep their leases.
Each end reports the node it cannot reach; the coordinator decides once, from one report, and both ends' reports lead
to the same node left out, whichever comes first (`axond.coordinator.state.linkcut`)."""

from __future__ import annotations

import pytest

from axond.coordinator.state.errors import InvalidArgument
from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.linkcut import evicted
from axond.coordinator.state.machine import CoordinatorState
from axond.fencing import fence_wait

INTERVAL, MISSED, MARGIN = 1.0, 3, 0.5


def live_job(nodes: int, min_nodes: int, max_restarts: int = 0,
             live: bool = True) -> tuple[CoordinatorState, list[str]]:
    state = CoordinatorState(heartbeat_interval=INTERVAL, dead_after_missed=MISSED, settle_time=5.0,
                             fence_margin=MARGIN)
    ids = [state.register_node(f"h{i}", 0, False, 0.0).node_id for i in range(nodes)]
    for n in ids:
        state.join("j", n, 1, min_nodes, nodes, max_restarts, now=0.0, live=live)
    assert state.jobs["j"].state is JobState.RUNNING
    ranks = {m.node_id: m.node_rank for m in state.jobs["j"].round.members or []}
    return state, sorted(ids, key=ranks.__getitem__)  # by node rank


def cut(state: CoordinatorState, node: str, unreachable: list[int], now: float,
        generation: int = 1) -> tuple[int, bool]:
    """What the servicer answers a report of unreachable nodes: (generation, will_restart and not left_job)."""
    got, will = state.report_failure("j", node, generation, -1, 0, "all_gather on group 'world' timed out", now=now,
                                     unreachable=unreachable)
    return got, will and not state.left_job("j", node)


def test_the_rule_one_link_leaves_its_higher_end_a_node_cut_from_most_leaves_itself() -> None:
    assert evicted(4, 1, [2]) == 2 and evicted(4, 2, [1]) == 2  # the same from both ends
    assert evicted(2, 0, [1]) == 1 and evicted(2, 1, [0]) == 1
    assert evicted(4, 0, [1, 2, 3]) == 0 and evicted(4, 3, [0, 1]) == 3  # cut from more than half of the others
    assert evicted(5, 0, [3, 4]) == 4  # half of the others, not more: the highest of the three


@pytest.mark.parametrize("first", ["low", "high"])
def test_either_end_reporting_first_leaves_out_the_higher_node_rank_and_keeps_the_rest_running(first: str) -> None:
    state, (a, b, c, d) = live_job(4, 2)
    j = state.jobs["j"]
    one, other = (b, c) if first == "low" else (c, b)
    expect_one = (2, True) if first == "low" else (2, False)  # the reporter kept goes on; c leaves
    assert cut(state, one, [2 if one == b else 1], now=10.0) == expect_one
    assert state.left_job("j", c) and not state.left_job("j", b)
    assert j.generation == 2 and j.round.expected == {a, b, d} and j.restarts == 0
    assert "cannot reach" in j.reason and "going on without node" in j.reason
    # the other end's report, about the generation before, gets the same decision (no second generation)
    assert cut(state, other, [1 if other == c else 2], now=10.1) == ((2, False) if other == c else (2, True))
    assert j.generation == 2
    assert state.heartbeat(b, "j", 1, now=10.2).live and not state.heartbeat(c, "j", 1, now=10.2).live


def test_the_next_generation_waits_for_the_fence_then_forms_without_the_evicted_node() -> None:
    state, (a, b, c, d) = live_job(4, 2)
    j = state.jobs["j"]
    cut(state, c, [1], now=10.0)
    fence = INTERVAL * MISSED + fence_wait(INTERVAL * MISSED, INTERVAL, MARGIN)  # a lease, then the fence
    for n, t in ((a, 10.1), (b, 10.2), (d, 10.3)):
        assert state.join("j", n, 1, 2, 4, 0, now=t, live=True) is None
    assert not j.round.frozen  # c's ranks may still run until its worker heard (the fence)
    for t in (11.5, 13.0, 10.0 + fence - 0.05):  # every node keeps its lease (c too: only its link is cut)
        for n in (a, b, c, d):
            state.heartbeat(n, "j", 2 if n != c else 1, now=t)
        state.tick(t)
    assert not j.round.frozen
    state.tick(10.0 + fence + 0.01)
    got = state.join_result("j", a, now=10.0 + fence + 0.02)
    assert got is not None and (got.generation, got.world_size) == (2, 3)
    assert {m.node_id for m in j.round.members or []} == {a, b, d}


def test_a_link_cut_leaving_too_few_nodes_restarts_as_before() -> None:
    state, (a, b) = live_job(2, 2, max_restarts=1)
    assert cut(state, a, [1], now=1.0) == (2, True)
    j = state.jobs["j"]
    assert j.restarts == 1 and not state.heartbeat(a, "j", 2, now=1.1).live and "too few nodes" in j.reason


def test_bad_reports_are_refused_and_change_nothing() -> None:
    state, (a, b, c) = live_job(3, 2)
    for bad in ([0], [3], [-1]):
        with pytest.raises(InvalidArgument, match="other node ranks"):
            cut(state, a, bad, now=1.0)
    assert state.jobs["j"].generation == 1
    plain, (x, y) = live_job(2, 2, live=False)
    with pytest.raises(InvalidArgument, match="live-recovery"):
        cut(plain, x, [1], now=1.0)
