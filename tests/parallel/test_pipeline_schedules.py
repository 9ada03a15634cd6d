"""Pipeline schedules as pure functions, checked without sockets.

The simulator below models the runtime exactly: sends are non-blocking appends to a FIFO per
(sender, receiver) link, a receive reads that link in order (parking early messages, as
`StageLinks` does) and blocks when nothing has arrived. A schedule passes if every rank finishes,
every message read is the one the receiver predicted with `incoming_order`, and nothing is left
unread; a deadlock is a round in which no rank progresses.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

import axond.nn as nn
from axond.parallel.pipeline.p2p import MessageKey, incoming_order
from axond.parallel.pipeline.schedules import (
    Action,
    PipelineSchedule,
    forward_actions,
    peak_in_flight,
    rank_actions,
    validate,
)
from axond.parallel.pipeline.split import balanced_split_points, split_sequential

GPIPE, ONE_F_ONE_B, INTERLEAVED = PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B


def configs() -> list[tuple[PipelineSchedule, int, int, int]]:
    """Every valid (schedule, P, M, v) with P <= 6, M <= 13, v <= 3."""
    out = []
    for schedule, p, m, v in itertools.product(PipelineSchedule, range(1, 7), range(1, 14), range(1, 4)):
        try:
            validate(schedule, p, m, v)
        except ValueError:
            continue
        out.append((schedule, p, m, v))
    return out


def simulate(lists: list[list[Action]], num_stages: int) -> None:
    """Run the rank lists as a message-passing dataflow; raise AssertionError on deadlock or mismatch."""
    size = len(lists)
    links: dict[tuple[int, int], list[MessageKey]] = {}
    read = {pair: 0 for pair in itertools.product(range(size), repeat=2)}
    expected = [incoming_order(lists, r, num_stages) for r in range(size)]
    mailbox: list[set[MessageKey]] = [set() for _ in range(size)]
    done: list[set[tuple[int, int]]] = [set() for _ in range(size)]
    pos = [0] * size

    def send(src: int, dst: int, key: MessageKey) -> None:
        if src == dst:
            mailbox[dst].add(key)
        else:
            links.setdefault((src, dst), []).append(key)

    def take(rank: int, src: int, key: MessageKey) -> bool:
        while key not in mailbox[rank]:
            sent = links.get((src, rank), [])
            i = read[(src, rank)]
            if i == len(sent):
                return False
            assert sent[i] == expected[rank][src][i], f"rank {rank} predicted {expected[rank][src][i]} from {src}, got {sent[i]}"
            mailbox[rank].add(sent[i])
            read[(src, rank)] = i + 1
        mailbox[rank].remove(key)
        return True

    progress = True
    while progress:
        progress = False
        for r in range(size):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                s = a.stage(r, size)
                if a.kind == "F":
                    if s > 0 and not take(r, (s - 1) % size, ("act", a.microbatch, s)):
                        break
                    if s + 1 < num_stages:
                        send(r, (s + 1) % size, ("act", a.microbatch, s + 1))
                else:
                    assert (a.microbatch, a.chunk) in done[r], f"rank {r}: backward {a} before its forward"
                    if s + 1 < num_stages and not take(r, (s + 1) % size, ("grad", a.microbatch, s)):
                        break
                    if s > 0:
                        send(r, (s - 1) % size, ("grad", a.microbatch, s - 1))
                if a.kind == "F":
                    done[r].add((a.microbatch, a.chunk))
                pos[r] += 1
                progress = True
    stuck = {r: lists[r][pos[r]] for r in range(size) if pos[r] < len(lists[r])}
    assert not stuck, f"deadlock: ranks blocked at {stuck}"
    for (src, dst), sent in links.items():
        assert read[(src, dst)] == len(sent), f"{len(sent) - read[(src, dst)]} messages {src}->{dst} never read"
    assert not any(mailbox), "messages received but never consumed"


@pytest.mark.parametrize("schedule,p,m,v", configs())
def test_each_microbatch_and_chunk_gets_one_forward_then_one_backward(schedule: PipelineSchedule, p: int, m: int, v: int) -> None:
    for r in range(p):
        actions = rank_actions(schedule, r, p, m, v)
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in actions)
        wanted = {(k, i, c) for k in "FB" for i in range(m) for c in range(v)}
        assert set(counts) == wanted and set(counts.values()) == {1}
        first = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)}
        assert all(first[("F", i, c)] < first[("B", i, c)] for i in range(m) for c in range(v))


@pytest.mark.parametrize("schedule,p,m,v", configs())
def test_schedule_runs_as_a_dataflow_without_deadlock(schedule: PipelineSchedule, p: int, m: int, v: int) -> None:
    simulate([rank_actions(schedule, r, p, m, v) for r in range(p)], p * v)
    simulate([forward_actions(schedule, r, p, m, v) for r in range(p)], p * v)


def test_simulator_rejects_bad_orders_and_deadlocks() -> None:
    bad = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(AssertionError, match="backward"):
        simulate(bad, 2)
    waits = [[Action("F", 1, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("F", 1, 0)]]
    simulate(waits, 2)  # receiver parks microbatch 1 until it needs it: fine
    cycle = [[Action("F", 0, 1), Action("F", 0, 0)], [Action("F", 0, 0), Action("F", 0, 1)]]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(cycle, 4)  # rank 0 waits on stage 1 before producing stage 0


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 6) for m in range(1, 12)])
def test_stashed_activations_gpipe_holds_all_and_1f1b_at_most_p(p: int, m: int) -> None:
    for r in range(p):
        assert peak_in_flight(rank_actions(GPIPE, r, p, m)) == m
        peak = peak_in_flight(rank_actions(ONE_F_ONE_B, r, p, m))
        assert peak == min(p - r, m) <= p


@pytest.mark.parametrize("p,v,m", [(p, v, m) for p in range(2, 6) for v in range(1, 4) for m in (p, 2 * p, 3 * p)])
def test_interleaved_stash_bound_and_megatron_order(p: int, v: int, m: int) -> None:
    for r in range(p):
        actions = rank_actions(INTERLEAVED, r, p, m, v)
        warmup = m * v if m == p else min(2 * (p - r - 1) + (v - 1) * p, m * v)
        assert peak_in_flight(actions) == min(warmup + 1, m * v)
        forwards = [(a.microbatch, a.chunk) for a in actions if a.kind == "F"]
        assert forwards[: p * v] == [(i, c) for c in range(v) for i in range(min(p, m))]
        backwards = [(a.microbatch, a.chunk) for a in actions if a.kind == "B"]
        assert backwards[:p] == [(i, v - 1) for i in range(p)]


def test_invalid_configurations_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="divisible by the pipeline size.*num_microbatches=5 with 2 ranks"):
        rank_actions(INTERLEAVED, 0, 2, 5, 2)
    with pytest.raises(ValueError, match="virtual_stages=2.*INTERLEAVED_1F1B"):
        rank_actions(ONE_F_ONE_B, 0, 2, 4, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        rank_actions(GPIPE, 0, 2, 0)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        rank_actions(GPIPE, 3, 2, 2)
    with pytest.raises(TypeError):
        validate("1f1b", 2, 2, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("n,k", [(n, k) for n in range(1, 8) for k in range(1, n + 1)])
def test_balanced_split_minimises_the_heaviest_stage(n: int, k: int) -> None:
    weights = [(7 * i * i + 3) % 11 + 1 for i in range(n)]
    points = balanced_split_points(weights, k)
    bounds = [0, *points, n]
    assert len(points) == k - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))

    def heaviest(cuts: tuple[int, ...]) -> int:
        b = [0, *cuts, n]
        return max(sum(weights[x:y]) for x, y in zip(b, b[1:]))

    best = min(heaviest(c) for c in itertools.combinations(range(1, n), k - 1))
    assert heaviest(tuple(points)) == best


def test_split_sequential_keeps_names_and_checks_split_points() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    stages = split_sequential(model, 3, split_points=[2, 4])
    assert [len(s) for s in stages] == [2, 2, 1]
    assert [n for s in stages for n, _ in s.named_parameters()] == [n for n, _ in model.named_parameters()]
    balanced = split_sequential(model, 3)
    assert sum(len(s) for s in balanced) == 5 and all(len(s) for s in balanced)
    with pytest.raises(ValueError, match="strictly increasing"):
        split_sequential(model, 3, split_points=[3, 2])
    with pytest.raises(ValueError, match="need 2 split points"):
        split_sequential(model, 3, split_points=[2])
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6"):
        split_sequential(model, 6)
