"""Random programs of collectives on overlapping groups, blocking and async, against NumPy references.

Four ranks (threads over real loopback sockets, or of the mock backend) build the same subgroups and run the same seeded program:
each step picks a group, an op, a dtype, a size that lands on a small, one-round or ring path, a root,
a reduce op, and whether to run it async (waited a few steps later, or at the end). Members run it;
the others go on to the next step, so ops on disjoint groups overlap and async ops on one group stay
in flight while others run. Every result is checked against NumPy: a lost, reordered or corrupted
message, or a scratch buffer shared where it must not be, shows up as a wrong array, a mismatch
error or a timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import axond
from axond import ProcessGroup, ReduceOp
from axond.testing import run_on
from collective_cases import reference

GROUPS = [[0, 1, 2, 3], [1, 3], [0, 2, 3], [1, 2]]
"""Global ranks of each group (index 0 is the world); every rank builds them all, in this order."""
OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all",
       "all_to_all_uneven", "barrier", "ring"]
ASYNC_OPS = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring"}
DTYPES = ["int32", "int64", "uint8", "int8", "float64"]
ROWS = [0, 1, 3, 17, 1000, 70_000, 300_000]
ROW_WEIGHTS = [0.1, 0.2, 0.15, 0.2, 0.15, 0.12, 0.08]


@dataclass
class Step:
    index: int
    group: int
    op: str
    dtype: str
    rows: int
    cols: int
    root: int
    redop: ReduceOp
    async_op: bool
    splits: np.ndarray
    """splits[s, d]: rows group rank s sends group rank d (uneven all_to_all)."""


def program(seed: int, length: int) -> list[Step]:
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(length):
        group = int(rng.integers(len(GROUPS)))
        size = len(GROUPS[group])
        op = OPS[int(rng.integers(len(OPS)))]
        rows = int(rng.choice(ROWS, p=ROW_WEIGHTS))
        if op in ("reduce_scatter", "all_to_all"):
            rows = max(rows // size, 1) * size
        redops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG] + ([ReduceOp.PRODUCT] if rows < 100 else [])
        dtype, cols, root = DTYPES[int(rng.integers(len(DTYPES)))], int(rng.choice([1, 3])), int(rng.integers(size))
        redop = redops[int(rng.integers(len(redops)))]
        if redop is ReduceOp.AVG and dtype != "float64":
            redop = ReduceOp.SUM  # AVG is refused on integers
        steps.append(Step(i, group, op, dtype, rows, cols, root, redop,
                          op in ASYNC_OPS and bool(rng.random() < 0.4), rng.integers(0, 5, (size, size))))
    return steps


def value(step: Step, group_rank: int, rows: int | None = None) -> np.ndarray:
    """Group rank `group_rank`'s input of `step`: small values, so sums and products are exact (or wrap alike)."""
    rng = np.random.default_rng([step.index, group_rank])
    shape = (step.rows if rows is None else rows, step.cols)
    low = 0 if step.dtype == "uint8" else -3
    return rng.integers(low, 4, shape).astype(step.dtype)


def expected(step: Step, r: int) -> Any:
    """What group rank `r` must get from `step` (None: nothing to check)."""
    n = len(GROUPS[step.group])
    xs = [value(step, s) for s in range(n)]
    op = step.op
    if op == "all_reduce" or (op == "reduce" and r == step.root):
        return reference(xs, step.redop)
    if op == "reduce":
        return None
    if op == "broadcast":
        return xs[step.root]
    if op == "all_gather" or (op == "gather" and r == step.root):
        return np.stack(xs)
    if op == "reduce_scatter":
        per = step.rows // n
        return reference(xs, step.redop)[r * per : (r + 1) * per]
    if op == "scatter":
        return xs[r]
    if op == "all_to_all":
        per = step.rows // n
        return np.concatenate([xs[s][r * per : (r + 1) * per] for s in range(n)])
    if op == "all_to_all_uneven":
        blocks = [uneven_input(step, s) for s in range(n)]
        return np.concatenate([blocks[s][step.splits[s, :r].sum() : step.splits[s, : r + 1].sum()] for s in range(n)])
    if op == "ring":
        return value(step, (r - 1) % n)
    return None


def uneven_input(step: Step, s: int) -> np.ndarray:
    return value(step, s, rows=int(step.splits[s].sum()))


def issue(step: Step, g: ProcessGroup) -> tuple[Any, Any]:
    """Run `step` on member `g`: (its Work or Works if async, else None; the array holding the result, if known)."""
    r, n, a = g.rank, g.size, step.async_op
    x = value(step, r)
    op = step.op
    if op == "all_reduce":
        return g.all_reduce(x, step.redop, async_op=a), x
    if op == "broadcast":
        return g.broadcast(x, step.root, async_op=a), x
    if op == "reduce":
        g.reduce(x, step.root, step.redop)
        return None, x
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        out = g.reduce_scatter(x, step.redop, async_op=a) if op == "reduce_scatter" else getattr(g, op)(x, async_op=a)
        return (out, None) if a else (None, out)  # async: the Work's result() is the array
    if op == "gather":
        return None, g.gather(x, step.root)
    if op == "scatter":
        full = np.stack([value(step, s) for s in range(n)]) if r == step.root else None
        return None, g.scatter(full, step.root)
    if op == "all_to_all_uneven":
        return None, g.all_to_all(uneven_input(step, r), input_split_sizes=list(step.splits[r]),
                                  output_split_sizes=None if step.index % 2 else list(step.splits[:, r]))
    if op == "ring":
        if n == 1:
            return None, x
        got = np.empty_like(x)
        works = axond.batch_isend_irecv([axond.P2POp(axond.irecv, got, g.global_rank_of((r - 1) % n), g, 9),
                                         axond.P2POp(axond.isend, x, g.global_rank_of((r + 1) % n), g, 9)])
        if not a:
            for w in works:
                w.wait()
            return None, got
        return works, got
    g.barrier()
    return None, None


@contextmanager
def subgroups(groups: list[ProcessGroup]) -> Iterator[list[list[ProcessGroup]]]:
    """Per global rank: its world group and its handles of GROUPS[1:] (built by every rank, destroyed after);
    the subgroups move data as the world does (see conftest's `make_groups` transport)."""
    def build(world: ProcessGroup) -> list[ProcessGroup]:
        return [world, *(world.new_group(ranks) for ranks in GROUPS[1:])]  # with the world's options
    subs = run_on(groups, build)
    try:
        yield subs
    finally:
        for own in subs:
            for s in own[1:]:
                s.destroy()


def run_steps(rank: int, mine: list[ProcessGroup], steps: list[Step],
              stop: Callable[[Step], bool] = lambda step: False) -> dict[int, Any] | None:
    """Run `steps` as global rank `rank` with its groups `mine`: results by step, or None if `stop` ended it."""
    results: dict[int, Any] = {}
    pending: list[tuple[int, Any, Any]] = []
    for step in steps:
        if stop(step):
            return None
        g = mine[step.group]
        if g.contains(rank):
            work, holder = issue(step, g)
            if work is None:
                results[step.index] = holder
            else:
                pending.append((step.index, work, holder))
        if step.index % 5 == 4:  # wait now and then, so that some async ops outlive later steps
            finish(pending, results)
    finish(pending, results)
    return results


def run_program(groups: list[ProcessGroup], steps: list[Step]) -> list[dict[int, Any]]:
    with subgroups(groups) as subs:
        return run_on(groups, lambda world: run_steps(world.rank, subs[world.rank], steps), timeout=120.0)


def finish(pending: list[tuple[int, Any, Any]], results: dict[int, Any]) -> None:
    for index, work, holder in pending:
        if isinstance(work, list):  # a ring: its isend and irecv
            assert all(w.wait(30.0) for w in work)
            results[index] = holder
        else:
            assert work.wait(30.0)
            results[index] = holder if holder is not None else work.result()
    pending.clear()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed, crowded, transport", [
    (11, None, "auto"), (12, None, "sockets"), (13, None, "shm"), (14, None, "auto"), (15, False, "sockets"),
    (16, False, "auto"), (17, False, "shm"), (18, None, "sockets"), (19, None, "nodes"), (20, False, "nodes"),
    (29, None, "spin"), (30, None, "spin"), (31, None, "mock"), (32, None, "mock")])
@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_a_random_program_matches_numpy_on_every_rank(make_groups: Any, seed: int, crowded: bool | None,
                                                      transport: str) -> None:
    """`crowded=False`: the algorithms of a host with a core per rank (rings rather than pairwise exchanges);
    `transport`: see conftest's TRANSPORTS (shm: every op of every group through its own small arena; spin: the same,
    its steps synchronized through the mailbox; nodes: the
    world all-reduces in two levels, group [1, 3] lies on one node, the others span nodes unevenly; mock: the
    socket-free backend)."""
    steps = program(seed, 50)
    assert {s.op for s in steps} >= {"all_reduce", "all_gather", "all_to_all_uneven"}
    world = make_groups(4, 20.0, crowded, transport)
    out = run_program(world, steps)
    if transport == "nodes":
        assert all(pg.backend.placement.levels is not None for pg in world)  # the world all-reduced in two levels
    checked = 0
    for global_rank, results in enumerate(out):
        for step in steps:
            ranks = sorted(GROUPS[step.group])
            if global_rank not in ranks:
                assert step.index not in results
                continue
            want = expected(step, ranks.index(global_rank))
            if want is None:
                continue
            got = results[step.index]
            assert got.dtype == want.dtype and got.shape == want.shape, (step, got.shape, want.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed} step {step.index} ({step.op}) rank {global_rank}")
            checked += 1
    assert checked > 60
