"""Shared by the checkpoint tests: a small model, its data, and each wrapper built over a group."""

from __future__ import annotations

from typing import Any

import numpy as np

from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW, Optimizer
from axond.parallel import DDP, FSDP, DeviceMesh, ShardingStrategy, ZeroRedundancyOptimizer

GLOBAL_BATCH = 12
X = np.random.default_rng(1).standard_normal((96, 7)).astype(np.float32)
Y = np.random.default_rng(2).integers(0, 5, 96)


def make_model() -> nn.Sequential:
    """Parameter sizes chosen so that no flat buffer divides evenly by 2, 3 or 4 ranks."""
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(7, 11, rng=rng), nn.GELU(), nn.LayerNorm(11), nn.Linear(11, 5, rng=rng))


def build(kind: str, group: ProcessGroup | None) -> tuple[Any, Optimizer]:
    """(wrapped model, optimizer) for kind in plain, ddp, zero, fsdp_full, fsdp_grad_op, fsdp_no_shard, fsdp_hybrid."""
    model = make_model()
    lr = dict(lr=0.05, weight_decay=0.01)
    if kind == "plain":
        return model, AdamW(list(model.parameters()), **lr)
    if kind == "ddp":
        return DDP(model, group), AdamW(list(model.parameters()), **lr)
    if kind == "zero":
        return DDP(model, group), ZeroRedundancyOptimizer(list(model.parameters()), AdamW, group, **lr)
    strategy = {"fsdp_full": ShardingStrategy.FULL_SHARD, "fsdp_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                "fsdp_no_shard": ShardingStrategy.NO_SHARD, "fsdp_hybrid": ShardingStrategy.HYBRID_SHARD}[kind]
    wrap = lambda m: isinstance(m, nn.Linear)  # noqa: E731  several units
    if strategy is ShardingStrategy.HYBRID_SHARD:
        assert group is not None
        fsdp = FSDP(model, sharding_strategy=strategy, mesh=DeviceMesh((2, group.size // 2), group=group), wrap=wrap)
    else:
        fsdp = FSDP(model, group, sharding_strategy=strategy, wrap=wrap)
    return fsdp, AdamW(list(fsdp.parameters()), **lr)


def train(model: Any, opt: Optimizer, rank: int, size: int, steps: range) -> None:
    """Optimizer steps over the global batches `steps`; this rank takes rows rank::size of each."""
    loss_fn = nn.CrossEntropyLoss()
    for s in steps:
        rows = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        x, y = X[rows][rank::size], Y[rows][rank::size]
        opt.zero_grad()
        model.zero_grad()
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()


def reference(steps: int) -> dict[str, np.ndarray]:
    """The parameters after `steps` single-process steps on the whole global batch."""
    model, opt = build("plain", None)
    train(model, opt, 0, 1, range(steps))
    return {k: v.copy() for k, v in model.state_dict().items()}
