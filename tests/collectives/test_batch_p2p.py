"""batch_isend_irecv / P2POp on real ranks over loopback: orders that deadlock when posted one by one.

Ranks are threads joined by real sockets, and threads of the mock backend. The tcp backend completes a group's async ops in issue order,
so an irecv listed before the matching isend on both sides of a pair deadlocks when posted one by one
(shown first, with a short timeout); in a batch the sends go first and it completes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import axond
from axond import DistributedError, P2POp, ProcessGroup
from axond.testing import run_on
from collective_cases import on_backend

MakeGroups = Callable[..., list[ProcessGroup]]
SIZE = 1 << 20  # 4 MiB of float32: beyond any socket buffer


@pytest.fixture(params=["tcp", "mock"])
def make_groups(make_groups: MakeGroups, request: pytest.FixtureRequest) -> MakeGroups:
    """conftest's, on the tcp and on the mock backend: both keep this contract."""
    return on_backend(make_groups, request.param)


def _ring(batched: bool) -> Callable[[ProcessGroup], np.ndarray]:
    """Every rank receives from its left first, then sends to its right (and the other way round)."""
    def body(g: ProcessGroup) -> np.ndarray:
        n, r = g.size, g.rank
        left, right = (r - 1) % n, (r + 1) % n
        got = np.empty((2, SIZE), np.float32)
        mine = np.full(SIZE, r, np.float32)
        ops = [P2POp(axond.irecv, got[0], left, g, tag=1), P2POp(axond.irecv, got[1], right, g, tag=2),
               P2POp(axond.isend, mine, right, g, tag=1), P2POp(axond.isend, mine + 100, left, g, tag=2)]
        if batched:
            works = axond.batch_isend_irecv(ops)
        else:
            works = [(g.irecv if o.op is axond.irecv else g.isend)(o.tensor, o.peer, o.tag) for o in ops]
        assert len(works) == 4
        for w in works:
            w.wait()
        return got

    return body


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_posted_one_by_one_the_ring_deadlocks_until_the_timeout(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 1.0)
    out = run_on(gs, _ring(batched=False), return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert "timed out" in str(out[0])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_batch_completes_whatever_the_order(make_groups: MakeGroups, n: int) -> None:
    gs = make_groups(n, 10.0)
    for r, got in enumerate(run_on(gs, _ring(batched=True))):
        assert (got[0] == (r - 1) % n).all() and (got[1] == (r + 1) % n + 100).all()


def test_a_subgroup_takes_global_peers_and_fills_non_contiguous_buffers(make_groups: MakeGroups) -> None:
    gs = make_groups(4)
    subs = run_on(gs, lambda g: g.new_group([1, 3]))

    def body(g: ProcessGroup) -> np.ndarray | None:
        sub = subs[g.rank]
        if not sub.contains(g.rank):
            return None
        other = 4 - g.rank  # global 1 <-> 3
        got = np.zeros((3, 4), np.int64)
        works = axond.batch_isend_irecv([P2POp(axond.irecv, got[:, 1], other, sub),
                                         P2POp(axond.isend, np.arange(3) * g.rank, other, sub)])
        assert works[0].wait(5.0) and works[1].wait(5.0)
        return got

    out = run_on(gs, body)
    for s in subs:
        s.destroy()
    assert out[0] is None and out[2] is None
    np.testing.assert_array_equal(out[1][:, 1], [0, 3, 6])
    np.testing.assert_array_equal(out[3][:, 1], [0, 1, 2])
    assert (out[1][:, [0, 2, 3]] == 0).all()


def test_bad_batches_are_refused_before_anything_starts(make_groups: MakeGroups) -> None:
    gs = make_groups(2)
    x = np.zeros(3)
    with pytest.raises(TypeError, match="op must be axond.isend or axond.irecv, got send"):
        P2POp(axond.send, x, 1, gs[0])
    with pytest.raises(ValueError, match="non-empty list of axond.P2POp"):
        axond.batch_isend_irecv([])
    with pytest.raises(ValueError, match="peer 0 is not another member"):
        axond.batch_isend_irecv([P2POp(axond.isend, x, 1, gs[0]), P2POp(axond.irecv, x, 0, gs[0])])
    with pytest.raises(ValueError, match="same group"):
        axond.batch_isend_irecv([P2POp(axond.isend, x, 1, gs[0]), P2POp(axond.irecv, x, 0, gs[1])])
    # nothing was sent: the pair still exchanges in step
    works = run_on(gs, lambda g: axond.batch_isend_irecv([P2POp(axond.isend, np.full(3, g.rank + 1.0), 1 - g.rank, g),
                                                          P2POp(axond.irecv, x if g.rank else np.zeros(3), 1 - g.rank, g)]))
    assert all(w.wait(5.0) for ws in works for w in ws)
    np.testing.assert_array_equal(x, [1.0, 1.0, 1.0])


def test_sends_and_receives_listed_in_different_tag_orders_match_by_tag(make_groups: MakeGroups) -> None:
    """As gloo: a receive takes the oldest send of its tag, whatever the order of the tags (frames of other tags
    read on the way are set aside)."""
    gs = make_groups(2, 2.0)
    got = {5: np.zeros(2), 6: np.zeros(2)}

    def body(g: ProcessGroup) -> None:
        if g.rank == 0:
            ops = [P2POp(axond.isend, np.full(2, 5.0), 1, g, tag=5), P2POp(axond.isend, np.full(2, 6.0), 1, g, tag=6)]
        else:
            ops = [P2POp(axond.irecv, got[6], 0, g, tag=6), P2POp(axond.irecv, got[5], 0, g, tag=5)]
        for w in axond.batch_isend_irecv(ops):
            w.wait()

    run_on(gs, body)
    np.testing.assert_array_equal(got[5], [5.0, 5.0])
    np.testing.assert_array_equal(got[6], [6.0, 6.0])
