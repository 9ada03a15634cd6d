"""Memory in bytes: the per-rank figures a strategy predicts (what a wrapper's optimizer holds: `optimizer_state`).

`memory_estimate` uses the same accounting as the wrappers' `memory_stats()`: parameters, gradients and
optimizer state that persist, plus the transient buffers of one step (working low-precision copies, gradient
buckets, gathered parameters and full gradients). FSDP units are chosen as FSDP's `wrap=` chooses them (default:
the whole model as one unit): a unit's gathered parameters and full gradient stay alive while the units inside it
run, so the peak is that of the deepest chain of nested units.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from axond.nn.device import is_cupy_array, parse_device
from axond.parallel.mixed_precision import MixedPrecision
from axond.parallel.fsdp.wrap import plan_units, select_unit_modules

if TYPE_CHECKING:
    from axond.parallel.fsdp.config import CPUOffload

STRATEGIES = ("ddp", "zero1", "fsdp", "shard_grad_op")


def memory_estimate(model: Any, strategy: str, world_size: int, mixed_precision: MixedPrecision | None = None,
                    optimizer_states: int = 2, wrap: Any = None, cpu_offload: CPUOffload | None = None,
                    device: str | None = None) -> dict[str, int]:
    """Predicted bytes per rank of `model` under `strategy` ("ddp", "zero1", "fsdp", "shard_grad_op").

    `optimizer_states` arrays of the masters' size per parameter (AdamW 2, SGD with momentum 1, plain SGD 0).
    `wrap`: FSDP's units, as FSDP's `wrap=` takes them (None: the model as one unit; without prefetching).
    `cpu_offload`: FSDP's `CPUOffload`; it moves bytes only for a model computing on a GPU (`device`, default:
    where the model's parameters are now), as FSDP does.
    Keys as the wrappers' `memory_stats()`: parameters, gradients, optimizer_state (buckets for DDP), current
    (their sum, between steps) and peak (with the largest buffers of a step that are alive together); offloaded
    (the part in host memory because of CPU offload), device_current and device_peak (the rest).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    mp = mixed_precision or MixedPrecision()
    params = [p for p in model.parameters() if p.requires_grad]
    offloading = cpu_offload is not None and cpu_offload.enabled
    if offloading and strategy not in ("fsdp", "shard_grad_op"):
        raise ValueError(f"cpu_offload applies to FSDP (strategy 'fsdp' or 'shard_grad_op'), not {strategy!r}")
    on_gpu = parse_device(device).kind == "cuda" if device is not None else bool(params) and is_cupy_array(params[0].data)
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
        units = _fsdp_units(model, wrap, world_size)
        shards = sum(p // world_size for p, _ in units)
        out = {"parameters": shards * m, "gradients": shards * g, "optimizer_state": optimizer_states * shards * m}
        transient = _fsdp_transient(units, c, r, keep_gathered=strategy == "shard_grad_op")
    offloaded = 0
    if cpu_offload is not None and offloading and on_gpu:
        offloaded = out["parameters"] + out["gradients"] + out["optimizer_state"]
        largest = max((p // world_size for p, _ in units), default=0)
        transient += largest * g  # a gradient shard on the device until its download is done (at most one pending)
        if cpu_offload.offload_params:
            transient += largest * m  # the next unit's shard, uploaded while this one computes
        else:
            out["device_shards"] = shards * m  # offload_optimizer keeps a device copy of every shard
    out["current"] = sum(out.values())
    out["peak"] = out["current"] + transient
    out["offloaded"] = offloaded
    out["device_current"] = out["current"] - offloaded
    out["device_peak"] = out["peak"] - offloaded
    return out


def memory_savings(model: Any, strategy: str, world_size: int, mixed_precision: MixedPrecision | None = None,
                   optimizer_states: int = 2) -> dict[str, float]:
    """Predicted peak bytes per rank of `strategy` against plain float32 DDP, and the fraction saved."""
    ddp = memory_estimate(model, "ddp", world_size, None, optimizer_states)["peak"]
    peak = memory_estimate(model, strategy, world_size, mixed_precision, optimizer_states)["peak"]
    return {"ddp_peak": ddp, "peak": peak, "saved": ddp - peak, "fraction_saved": (ddp - peak) / ddp if ddp else 0.0}


def _fsdp_units(model: Any, wrap: Any, world_size: int) -> list[tuple[int, list[int]]]:
    """Per FSDP unit (root first): its padded element count and the indices of the units it runs inside (itself
    included), as `FullyShardedDataParallel(model, wrap=wrap)` would build them."""
    plans = plan_units(model, select_unit_modules(model, wrap))  # units that own parameters
    inside = [{id(d) for d in plan.module.modules()} for plan in plans]
    units = []
    for plan in plans:
        numel = sum(int(p.size) for p in plan.params)
        chain = [j for j in range(len(plans)) if id(plan.module) in inside[j]]
        units.append((math.ceil(numel / world_size) * world_size, chain))
    return units


def _fsdp_transient(units: list[tuple[int, list[int]]], c: int, r: int, keep_gathered: bool) -> int:
    """The most bytes of gathered parameters (c per element), full gradients (c) and reduce-dtype copies (r, when it
    differs) alive at once in a step. FULL_SHARD: a unit's backward holds the gathered parameters and full gradients
    of every unit it runs inside, plus its own cast copy while its reduce-scatter starts; SHARD_GRAD_OP keeps every
    unit gathered from the forward into the backward."""
    cast = r if r != c else 0
    gathered_all = sum(p for p, _ in units) * c
    worst = 0
    for padded, chain in units:
        held = sum(units[j][0] for j in chain)
        gathered = gathered_all if keep_gathered else held * c
        worst = max(worst, gathered + held * c + padded * cast)
    return worst