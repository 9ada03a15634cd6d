"""FSDP on virtual ranks (`DistributedTrainer(parallel="fsdp", virtual_ranks=V)`): the same bits at every world size
(clipping included), each rank receiving only its blocks of the reduced gradient, and what it refuses."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.parallel.fsdp.virtual import VirtualFSDP
from axond.parallel.zero.virtual import carried
from axond.testing import RankFailed, run_threads
from axond.train import Callback, DistributedTrainer
from axond.train.sharded import ShardedGradients

X = np.random.default_rng(5).standard_normal((96, 6)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int64) + (X[:, 2] > 0.5)


def trainer(group: ProcessGroup, callbacks: list[Callback], **options: Any) -> DistributedTrainer:
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(6, 16, rng=rng), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3, rng=rng))
    return DistributedTrainer(model, lambda params: AdamW(params, lr=0.01), nn.CrossEntropyLoss(), (X, Y),
                              batch_size=4, progress=False, callbacks=callbacks, group=group, **options)


class Hashes(Callback):
    def __init__(self) -> None:
        self.hashes: list[str] = []
        self.norms: list[float] = []

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        digest = hashlib.sha256()
        for value in trainer.module.state_dict().values():
            digest.update(np.ascontiguousarray(value).tobytes())
        self.hashes.append(digest.hexdigest())
        grads = trainer.virtual.grads if trainer.virtual is not None else None
        self.norms.append(float(getattr(grads, "norm", 0.0)))


def hashes(world: int, **options: Any) -> Hashes:
    seen = Hashes()
    run_threads(lambda g: trainer(g, [seen] if g.rank == 0 else [], virtual_ranks=3, **options).fit(2), world, 120.0)
    return seen


def test_fsdp_on_virtual_ranks_gives_the_same_bits_at_every_world_size_clipping_included() -> None:
    one = hashes(1, parallel="fsdp", clip_norm=0.05)
    assert len(one.hashes) == 16 and len(set(one.hashes)) == 16  # every step changed the parameters
    assert all(n > 0.05 for n in one.norms)  # the clipping scaled every step
    for world in (2, 3):
        assert hashes(world, parallel="fsdp", clip_norm=0.05).hashes == one.hashes


def test_without_clipping_fsdp_computes_the_bits_of_zero1_on_the_same_virtual_ranks() -> None:
    """The reduce-scatter sums each element in the order of the all_gather-and-sum of parallel='zero' ('ddp'), and the
    optimizer is element-wise: only the global norm is summed otherwise (per virtual shard)."""
    assert hashes(2, parallel="fsdp").hashes == hashes(3, parallel="zero").hashes


def test_each_rank_receives_only_its_blocks_of_the_reduced_gradient() -> None:
    def train(group: ProcessGroup) -> tuple[int, int, int, list[range]]:
        t = trainer(group, [], parallel="fsdp", virtual_ranks=3)
        t.fit(1)
        fsdp = t.optimizer
        assert isinstance(fsdp, VirtualFSDP) and isinstance(t.virtual.grads, ShardedGradients)
        held = np.zeros(fsdp.layout.padded_numel, bool)
        for block in fsdp.reduced:
            held[fsdp.span(block)] = True
        outside = int(np.count_nonzero(fsdp.grad[~held]))  # never written: no rank holds the whole gradient
        return outside, t.virtual.grads.chunk, fsdp.layout.padded_numel, fsdp.reduced

    results = run_threads(train, 3, 120.0)
    for rank, (outside, chunk, padded, reduced) in enumerate(results):
        assert outside == 0
        # its own block and its buddy source's (rank - 1): two of the three shards' elements, not all of them
        assert [(b.start, b.stop) for b in reduced] == [(rank, rank + 1), ((rank - 1) % 3, (rank - 1) % 3 + 1)]
        assert chunk < padded


def test_fsdp_on_virtual_ranks_refuses_the_fast_mode_and_wrapper_options() -> None:
    def build(group: ProcessGroup, **options: Any) -> None:
        trainer(group, [], parallel="fsdp", virtual_ranks=2, **options)

    with pytest.raises(RankFailed, match="deterministic=True"):
        run_threads(lambda g: build(g, deterministic=False), 1, 60.0)
    with pytest.raises(RankFailed, match="no wrapper_options"):
        run_threads(lambda g: build(g, wrapper_options={"num_microbatches": 2}), 1, 60.0)


def test_the_reduce_scatter_sends_each_rank_exactly_its_blocks_when_ranks_carry_unequal_numbers_of_rows() -> None:
    """Four virtual ranks on three ranks (rank 2 carries two): the all_to_all's splits are exact, no padding row (for
    the ranks carrying one) and no padding column (for the destinations routed fewer shards); the bits are those of
    one process."""
    def sizes(group: ProcessGroup) -> tuple[list[int], list[int], list[int], int, int]:
        t = trainer(group, [], parallel="fsdp", virtual_ranks=4)
        t.fit(1)
        g, fsdp = t.virtual.grads, t.optimizer
        assert isinstance(g, ShardedGradients) and isinstance(fsdp, VirtualFSDP)
        return g.ins, g.outs, [sum(len(b) for b in blocks) for blocks in fsdp.routes], fsdp.shard, g.extra

    results = run_threads(sizes, 3, 120.0)
    carries = [len(carried(r, 3, 4)) for r in range(3)]
    assert carries == [1, 1, 2]
    for me, (ins, outs, routed, shard, extra) in enumerate(results):
        assert ins == [carries[me] * (routed[d] * shard + extra) for d in range(3)]
        assert outs == [carries[src] * (routed[me] * shard + extra) for src in range(3)]
    assert sum(results[0][0]) < 3 * 2 * max(results[0][0])  # padded to two rows and the widest route, it was more
    four = Hashes()
    run_threads(lambda g: trainer(g, [four] if g.rank == 0 else [], parallel="fsdp", virtual_ranks=4).fit(2), 1, 120.0)
    three = Hashes()
    run_threads(lambda g: trainer(g, [three] if g.rank == 0 else [], parallel="fsdp", virtual_ranks=4).fit(2), 3, 120.0)
    assert three.hashes == four.hashes
