"""Virtual data-parallel ranks: the blocks ranks carry, the fixed order gradients are summed in, and a trainer whose
parameters are bit for bit the same at every world size."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.testing import RankFailed, run_threads
from axond.train import DistributedTrainer
from axond.errors import DistributedError
from axond.train.live import roll_forward
from axond.train.virtual import carried, ordered_mean, owners

X = np.random.default_rng(5).standard_normal((96, 6)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int64) + (X[:, 2] > 0.5)


@pytest.mark.parametrize("virtual", [1, 3, 4, 7])
def test_every_world_size_carries_each_virtual_rank_once_in_contiguous_blocks(virtual: int) -> None:
    for world in range(1, virtual + 1):
        blocks = [carried(r, world, virtual) for r in range(world)]
        assert [v for b in blocks for v in b] == list(range(virtual))
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        assert owners(world, virtual) == [(r, i) for r, b in enumerate(blocks) for i in range(len(b))]


def test_a_world_larger_than_the_virtual_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot carry 2 virtual ranks"):
        carried(0, 3, 2)


def _blocks(rows: np.ndarray, world: int) -> np.ndarray:
    """`rows` (one per virtual rank) laid out as an all_gather over `world` ranks brings them (padded blocks)."""
    virtual = rows.shape[0]
    width = -(-virtual // world)
    gathered = np.full((world, width, rows.shape[1]), np.nan, rows.dtype)  # padding must never be read
    for v, (r, i) in enumerate(owners(world, virtual)):
        gathered[r, i] = rows[v]
    return gathered


def test_the_mean_is_summed_in_virtual_rank_order_whatever_the_world_size() -> None:
    rows = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32) * np.float32(1e4)
    rows[:3, 0] = (1e8, 1.0, -1e8)  # a sum whose order shows: (1e8 + 1) - 1e8 is 0 in float32, 1e8 - 1e8 + 1 is 1
    expected = rows[0].copy()
    for v in range(1, 5):
        expected += rows[v]
    expected /= np.float32(5)
    for world in range(1, 6):
        out = np.empty(1000, np.float32)
        got = ordered_mean(_blocks(rows, world), owners(world, 5), out)
        assert got is out and np.array_equal(got, expected), world
    reordered = rows[::-1].copy()
    other = np.empty(1000, np.float32)
    ordered_mean(_blocks(reordered, 2), owners(2, 5), other)
    assert not np.array_equal(other, expected)  # the order matters: it is fixed, not left to the world size


def _train(group: ProcessGroup, **options: Any) -> tuple[dict[str, np.ndarray], list[float]]:
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(6, 10, rng=rng), nn.Tanh(), nn.Dropout(0.2, seed=group.rank),
                          nn.Linear(10, 3, rng=rng))
    trainer = DistributedTrainer(model, lambda params: AdamW(params, lr=0.02), nn.CrossEntropyLoss(), (X, Y),
                                 batch_size=4, group=group, progress=False, clip_norm=1.0, **options)
    history = trainer.fit(2)
    return {k: v.copy() for k, v in model.state_dict().items()}, [h["loss"] for h in history]


@pytest.mark.parametrize("parallel", ["ddp", "zero"])
def test_the_parameters_are_bit_identical_at_every_world_size(parallel: str) -> None:
    """ZeRO-1's shards are cut on the virtual ranks too: it steps the same bits as DDP at every world size."""
    runs = {world: run_threads(lambda g: _train(g, virtual_ranks=3, parallel=parallel), world, 60.0)
            for world in (1, 2, 3)}
    reference, losses = run_threads(lambda g: _train(g, virtual_ranks=3), 3, 60.0)[0]
    for world, results in runs.items():
        for params, history in results:
            assert history == losses, world
            for name, value in params.items():
                assert np.array_equal(value, reference[name]), (world, name)


def test_virtual_ranks_need_parallel_ddp_zero_or_fsdp() -> None:
    with pytest.raises(ValueError, match="virtual_ranks"):
        _train(ProcessGroup.mock(), virtual_ranks=2, parallel="tp")
    with pytest.raises(ValueError, match="copy_every"):
        _train(ProcessGroup.mock(), virtual_ranks=2, parallel="zero", copy_every=0)
    with pytest.raises(RankFailed, match="fewer than the 2 ranks"):
        run_threads(lambda g: _train(g, virtual_ranks=1), 2, 60.0)


def test_a_step_committed_anywhere_is_applied_everywhere_and_never_twice() -> None:
    assert not roll_forward([20, 20], 20, pending=True)  # nobody's commit completed: the step runs again
    assert not roll_forward([20, 20], 20, pending=False)
    assert roll_forward([21, 20], 20, pending=True)  # another rank's commit completed: apply the held gradient
    assert not roll_forward([21, 20], 21, pending=False)  # the rank that applied it does not apply it again
    with pytest.raises(DistributedError, match="holds no gradient"):
        roll_forward([21, 20], 20, pending=False)
    with pytest.raises(DistributedError, match="more than one"):
        roll_forward([22, 20], 20, pending=True)


def test_the_fast_mode_reorders_sums_only() -> None:
    runs = {world: run_threads(lambda g: _train(g, virtual_ranks=3, deterministic=False), world, 60.0)
            for world in (1, 2, 3)}
    exact, exact_losses = run_threads(lambda g: _train(g, virtual_ranks=3), 1, 60.0)[0]
    for world, results in runs.items():
        for params, history in results:
            np.testing.assert_allclose(history, exact_losses, rtol=1e-5)  # the bound for a fast mode
            for name, value in params.items():
                np.testing.assert_allclose(value, exact[name], rtol=1e-4, atol=1e-6)
