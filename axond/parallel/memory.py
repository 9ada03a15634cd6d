"""Memory in bytes: what a wrapper's optimizer holds, and the per-rank figures a strategy predicts.

`memory_estimate` uses the same accounting as the wrappers' `memory_stats()` (whole model as one
FSDP unit): parameters, gradients and optimizer state that persist, plus the transient buffers of
one step (working low-precision copies, gradient buckets, gathered parameters and full gradients).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from axond.parallel.mixed_precision import MixedPrecision

STRATEGIES = ("ddp", "zero1", "fsdp", "shard_grad_op")


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the arrays in `optimizer.state` (an axond.nn.optim optimizer or ZeRO-1's), 0 for None."""
    if optimizer is None:
        return 0
    return sum(int(v.nbytes) for st in getattr(optimizer, "state", []) for v in st.values() if hasattr(v, "nbytes"))


def memory_estimate(model: Any, strategy: str, world_size: int, mixed_precision: MixedPrecision | None = None,
                    optimizer_states: int = 2) -> dict[str, int]:
    """Predicted bytes per rank of `model` under `strategy` ("ddp", "zero1", "fsdp", "shard_grad_op").

    `optimizer_states` arrays of the masters' size per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    Keys as the wrappers' `memory_stats()`: parameters, gradients, optimizer_state (buckets for DDP), current
    (their sum, between steps) and peak (with the largest buffers of a step that are alive together).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    mp = mixed_precision or MixedPrecision()
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.size for p in params)
    master = np.dtype(params[0].dtype) if params else np.dtype(np.float32)
    m, c = master.itemsize, mp.compute(master).itemsize
    r, g = mp.reduce(master).itemsize, mp.grad(master).itemsize
    shard = max(1, math.ceil(numel / world_size))
    padded = shard * world_size
    low = numel * c if mp.compute(master) != master else 0
    if strategy == "ddp":
        out = {"parameters": numel * m, "gradients": numel * g, "optimizer_state": optimizer_states * numel * m,
               "buckets": (numel + len(params)) * r}
        transient = 2 * low  # working copies and their low-precision gradients, from forward to the reduction
    elif strategy == "zero1":
        out = {"parameters": padded * m, "gradients": numel * g + shard * m,
               "optimizer_state": optimizer_states * shard * m}
        transient = padded * m  # the flat copy of the local gradients that is reduce-scattered
    else:
        out = {"parameters": shard * m, "gradients": shard * g, "optimizer_state": optimizer_states * shard * m}
        transient = 2 * padded * c + (padded * r if r != c else 0)  # gathered unit, its gradient, a cast copy
    out["current"] = sum(out.values())
    out["peak"] = out["current"] + transient
    return out


def memory_savings(model: Any, strategy: str, world_size: int, mixed_precision: MixedPrecision | None = None,
                   optimizer_states: int = 2) -> dict[str, float]:
    """Predicted peak bytes per rank of `strategy` against plain float32 DDP, and the fraction saved."""
    ddp = memory_estimate(model, "ddp", world_size, None, optimizer_states)["peak"]
    peak = memory_estimate(model, strategy, world_size, mixed_precision, optimizer_states)["peak"]
    return {"ddp_peak": ddp, "peak": peak, "saved": ddp - peak, "fraction_saved": (ddp - peak) / ddp if ddp else 0.0}
