"""Buddy copies of ZeRO-1 shards: who copies to whom, the double-buffered slots and their tags (a copy of a step that
was not committed everywhere is never used), the replay that advances an older copy, and the choice of providers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from axond import nn
from axond.distributed import ProcessGroup
from axond.errors import DistributedError
from axond.nn.module import Parameter
from axond.nn.optim import AdamW
from axond.parallel.zero.virtual import VirtualZero, carried
from axond.testing import run_threads
from axond.train.buddy import BuddyCopies, Holding, Slot, buddies
from axond.train.reassemble import Reassembled, providers, reassemble


def test_the_buddy_is_the_next_rank_on_another_node() -> None:
    assert buddies([0, 1, 2]) == [1, 2, 0]
    assert buddies([7, 7, 8]) == [2, 2, 0]  # ranks 0 and 1 share a node: both copy to rank 2
    assert buddies([4, 4, 4]) == [1, 2, 0]  # one node: the next rank
    assert buddies([3]) == [-1]


def _holding() -> Holding:
    return Holding(2, range(2, 3), [Slot(np.zeros((1, 3, 4), np.float32), np.zeros((1, 2))) for _ in range(2)])


def _receive(h: Holding, tag: int, header: int | None = None) -> Slot:
    slot = h.begin(tag)
    slot.rows[:] = tag
    slot.scalars[:, 0] = tag if header is None else header
    h.received()
    return slot


def _used(h: Holding, agreed: int) -> tuple[Slot | None, int]:
    """(the slot `usable` picks, how many steps it advances it by); (None, 0) when none."""
    found = h.usable(agreed)
    return (found[0], len(found[1])) if found is not None else (None, 0)


def test_only_complete_copies_of_committed_steps_are_used() -> None:
    h = _holding()
    assert h.usable(0) is None  # nothing received yet
    five = _receive(h, 5)
    assert _used(h, 5) == (five, 0)
    six = h.begin(6)  # the receive of step 6 is in flight: step 5's copy is kept, never overwritten
    assert six is not five and six.tag is None
    assert h.usable(6) is None  # the copy in flight is never read, and no gradient advances step 5's
    grad6 = np.full(4, 6.0, np.float32)
    h.keep(6, grad6, limit=2)
    found = h.usable(6)
    assert found is not None and found[0] is five and np.array_equal(found[1][0], grad6)
    six.scalars[:, 0] = 6
    h.received()
    assert six.tag == 6
    seven = _receive(h, 7)  # into the older slot (step 5's)
    assert seven is five and _used(h, 6) == (six, 0)  # a copy of step 7, not committed everywhere: never used
    assert _used(h, 7) == (seven, 0)
    h.begin(8)  # overwrites step 6's slot; cut before it completed
    h.cut()
    assert h.usable(8) is None and _used(h, 7) == (seven, 0)


def test_a_copy_whose_header_names_another_step_is_refused() -> None:
    h = _holding()
    with pytest.raises(DistributedError, match="carries step"):
        _receive(h, 4, header=3)
    assert h.usable(4) is None and h.usable(3) is None


def test_kept_gradients_reuse_their_buffers_up_to_the_limit() -> None:
    h = _holding()
    made = set()
    for step in range(1, 6):
        buf = h.next_buffer(4, np.dtype(np.float32))
        made.add(id(buf))
        buf[:] = step
        h.keep(step, buf, limit=2)
    assert sorted(h.grads) == [4, 5] and [float(h.grads[s][0]) for s in (4, 5)] == [4.0, 5.0]
    assert len(made) == 3 and len(h.spare) == 1  # two kept, one spare for the next step: no buffer made after that


def test_a_new_layout_reuses_the_kept_gradients_buffers() -> None:
    """Between copies every few steps the buddy keeps its sources' gradients in buffers made when the copies are
    placed (their pages written then, never in a step); a re-formation's layout takes the old ones back."""

    def body(group: ProcessGroup) -> tuple[int, int, bool]:
        model = nn.Sequential(nn.Linear(64, 64, rng=np.random.default_rng(0)))
        zero = VirtualZero(list(model.parameters()), AdamW, group, 2, lr=0.05)
        copies = BuddyCopies(zero, 3)
        copies.place(group, [0, 1])
        (h,) = copies.holdings
        first = {id(b) for b in h.spare}
        copies.before_step()
        (_, buf), = copies.diverted
        buf[:] = 1.0  # as the step would, then kept
        zero.holes = list(zero.divert)
        copies.after_step()
        zero.place(group, None)  # as a re-formation: the shards first (the diverted span taken back), then the copies
        copies.place(group, [0, 1])
        (again,) = copies.holdings
        return len(first), len(again.spare), {id(b) for b in again.spare} == first

    for made, spare, same in run_threads(body, 2, 60.0):
        assert (made, spare, same) == (5, 5, True)


def _carrying_first_shard(seed: int) -> VirtualZero:
    """A VirtualZero of three virtual shards whose rank carries shard 0 only (as rank 0 of three would)."""
    model = nn.Sequential(nn.Linear(5, 7, rng=np.random.default_rng(0)), nn.Linear(7, 3, rng=np.random.default_rng(1)))
    params = list(model.parameters())
    zero = VirtualZero(params, AdamW, ProcessGroup.mock(), 3, lr=0.05)
    zero.mine, zero.shards = range(0, 1), zero.shards[:1]
    zero.optim.params, zero.optim.state = zero.optim.params[:1], zero.optim.state[:1]
    for p in params:
        p.grad = np.random.default_rng(seed).standard_normal(p.shape).astype(np.float32)
    return zero


def test_a_diverted_step_keeps_the_gradient_without_changing_the_step() -> None:
    """`VirtualZero.divert`: the step writes the span of the gradient of shards it does not carry into another buffer
    (a buddy's kept gradient), without a copy; the update is the same bits, `whole_grad` puts the span back."""
    plain, zero = _carrying_first_shard(2), _carrying_first_shard(2)
    span = zero.span(range(1, 3))
    buf = np.full(span.stop - span.start, np.nan, np.float32)
    zero.divert = [(span, buf)]
    plain.step()
    zero.step()
    assert np.array_equal(zero.flat, plain.flat) and np.array_equal(buf, plain.grad[span])
    assert zero.divert == [] and len(zero.holes) == 1
    assert np.array_equal(zero.whole_grad(), plain.grad) and zero.holes == []
    own = _carrying_first_shard(3)
    own.divert = [(own.span(range(0, 1)), np.empty(own.shard, np.float32))]
    with pytest.raises(ValueError, match="carries"):
        own.step()


def test_an_older_copy_is_advanced_bit_for_bit_as_its_owner_stepped() -> None:
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(5, 7, rng=rng), nn.Linear(7, 3, rng=rng))
    params = list(model.parameters())
    zero = VirtualZero(params, AdamW, ProcessGroup.mock(), 3, lr=0.05)
    (rows_shape, scalars_shape) = zero.rows_shape(1)
    old_rows, old_scalars = np.empty(rows_shape[1:], np.float32), np.empty(scalars_shape[1:])
    grads = []
    for step in range(3):
        for p in params:
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
        zero.step()
        grads.append(zero.grad[zero.span(range(1, 2))].copy())
        if step == 0:
            zero.pack(1, old_rows, old_scalars)
    now_rows, now_scalars = np.empty_like(old_rows), np.empty_like(old_scalars)
    zero.pack(1, now_rows, now_scalars)
    zero.replay(old_rows, old_scalars, grads[1:])
    assert np.array_equal(old_rows, now_rows) and np.array_equal(old_scalars, now_scalars)
    assert now_scalars[0] == 3 and now_scalars[1] == 3  # the tag and AdamW's step


def test_each_shard_comes_from_its_best_offer_or_is_lost() -> None:
    table = np.array([[3, 0, 2, 0], [0, 3, 1, 0]])  # rank 0 owns shard 0 and holds a copy of 2; rank 1 owns 1
    assert providers(table) == [0, 1, 0, -1]


STEPS = 4


def _grads(params: list[Parameter], step: int) -> None:
    rng = np.random.default_rng(100 + step)  # the same averaged gradient on every rank, as the virtual-rank gather
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)


def _params() -> list[Parameter]:
    rng = np.random.default_rng(1)
    return list(nn.Sequential(nn.Linear(5, 9, rng=rng), nn.Linear(9, 4, rng=rng)).parameters())


def _survive(group: ProcessGroup, last_copy_lands: bool) -> tuple[Reassembled, np.ndarray, list[dict[str, Any]]] | None:
    """Three ranks step ZeRO-1 with buddy copies; rank 2 leaves after step STEPS (its last copy landed or not); ranks 0
    and 1 rebuild every shard over a group of two. Returns (the result, the parameters, the states carried)."""
    params = _params()
    zero = VirtualZero(params, AdamW, group, 3, lr=0.05)
    copies = BuddyCopies(zero, 1)
    copies.place(group, [0, 1, 2])
    copies.post()
    for step in range(1, STEPS + 1):
        copies.settle()
        _grads(params, step)
        zero.step()
        copies.after_step()
        zero.publish()
        if step < STEPS or last_copy_lands:
            copies.post()
    copies.settle()
    survivors = group.new_group([0, 1])
    if group.rank == 2:
        return None  # gone: everything it carried lives on in rank 0's copy
    done = reassemble(zero, copies.holdings, survivors, STEPS)
    return done, zero.flat.copy(), [dict(st) for st in zero.optim.state]


@pytest.mark.parametrize("last_copy_lands", [True, False])
def test_survivors_rebuild_a_lost_shard_from_its_copy_as_if_nobody_left(last_copy_lands: bool) -> None:
    """With the last copy landed it is used as is; without, the copy of the step before is advanced by the kept
    gradient: either way the parameters and the state equal those of one process that stepped every shard."""
    params = _params()
    whole = VirtualZero(params, AdamW, ProcessGroup.mock(), 3, lr=0.05)
    for step in range(1, STEPS + 1):
        _grads(params, step)
        whole.step()
    results = run_threads(lambda g: _survive(g, last_copy_lands), 3, 60.0)
    assert results[2] is None
    for rank, result in enumerate(results[:2]):
        assert result is not None
        done, flat, states = result
        assert done.lost == [] and done.from_copies == [2] and done.replayed == ([] if last_copy_lands else [2])
        assert np.array_equal(flat, whole.flat)
        for st, v in zip(states, carried(rank, 2, 3)):
            want = whole.optim.state[v]
            assert st["step"] == want["step"] == STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(st[key], want[key]), (rank, v, key)
