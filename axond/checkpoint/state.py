"""`get_state_dict` / `set_state_dict`: model and optimizer state keyed by the unwrapped model's names.

The optimizer state is `{"state": {param_name: {"step": int, "exp_avg": leaf, ...}}, "defaults": {...}}`
whatever the wrapper, so a checkpoint saved under FSDP loads under DDP or ZeRO-1 and vice versa.
An optimizer that has not stepped yet gets its state created first (AdamW: zeros and step 0, exactly
what its first step would create), so that there is something to load into.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from axond.checkpoint.adapters import ParamView, Views, _flat_views, model_views
from axond.checkpoint.metadata import CheckpointError
from axond.checkpoint.sharded import ShardedTensor, as_sharded, intersect, is_array, iter_leaves, local_slices
from axond.nn.device import Array, array_module, is_cupy_array, to_device, device_of
from axond.nn.optim import AdamW, Optimizer
from axond.parallel.zero.optimizer import ZeroRedundancyOptimizer
from axond.parallel.zero.virtual import VirtualZero


def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create the per-parameter state a first step would create (AdamW); other optimizers are left alone."""
    if not isinstance(optimizer, AdamW):
        return
    for p, st in zip(optimizer.params, optimizer.state):
        if st or not p.requires_grad:
            continue
        xp = array_module(p.data)
        st["step"] = 0
        st["exp_avg"] = xp.zeros_like(p.data)
        st["exp_avg_sq"] = xp.zeros_like(p.data)
        if optimizer.defaults.get("amsgrad"):
            st["max_exp_avg_sq"] = xp.zeros_like(p.data)


def _entries(optimizer: Optimizer, views: Views) -> list[tuple[dict[str, Any], Array, list[ParamView]]]:
    """(state dict of one optimizer parameter, its data, the global parameters it holds), for any optimizer."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        init_optimizer_state(optimizer.optim)
        out = []
        for b, st in zip(optimizer.buckets, optimizer.optim.state):
            names = []
            for p in b.params:
                if id(p) not in views:
                    raise CheckpointError("a parameter of the ZeroRedundancyOptimizer is not a parameter of the model")
                names.append(views[id(p)][0].names)
            out.append((st, b.shard.data, _flat_views(b.layout, optimizer.group.rank, names)))
        return out
    if isinstance(optimizer, VirtualZero):  # ZeRO-1 on virtual ranks: one flat shard per virtual rank carried
        init_optimizer_state(optimizer.optim)
        if any(id(p) not in views for p in optimizer.params):
            raise CheckpointError("a parameter of the ZeRO-1 optimizer is not a parameter of the model")
        names = [views[id(p)][0].names for p in optimizer.params]
        return [(st, shard.data, _flat_views(optimizer.layout, v, names))
                for v, st, shard in zip(optimizer.mine, optimizer.optim.state, optimizer.shards)]
    init_optimizer_state(optimizer)
    out = []
    for i, (p, st) in enumerate(zip(optimizer.params, optimizer.state)):
        if id(p) not in views:
            raise CheckpointError(f"optimizer parameter {i} (shape {p.shape}) is not a parameter of the model; build the "
                                  "optimizer from the wrapped model's parameters() (after wrapping)")
        out.append((st, p.data, views[id(p)]))
    return out


def optimizer_views(optimizer: Optimizer, views: Views) -> dict[str, Any]:
    state: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for st, data, pviews in _entries(optimizer, views):
        for v in pviews:
            entry = state.setdefault(v.names[0], {})
            for key, value in st.items():
                if is_array(value):
                    if tuple(value.shape) != tuple(data.shape):
                        raise CheckpointError(f"optimizer state {key!r} of {v.names[0]!r} has shape {tuple(value.shape)}, "
                                              f"not its parameter's {tuple(data.shape)}; axond.checkpoint cannot shard it")
                    leaf, held = v.to_leaf(value), entry.get(key)
                    if isinstance(held, ShardedTensor) and isinstance(leaf, ShardedTensor):  # one rank, two shards
                        leaf = ShardedTensor(leaf.global_shape, leaf.dtype, held.chunks + leaf.chunks)
                    entry[key] = leaf
                else:
                    entry[key] = value
    return {"state": state, "defaults": dict(optimizer.defaults)}


def get_state_dict(model: Any, optimizer: Optimizer | None = None) -> tuple[OrderedDict[str, Any], dict[str, Any] | None]:
    """(model state, optimizer state) of any wrapper, as views of the live arrays (no copy, no communication).

    Tensors this rank holds whole are plain arrays; sharded ones (FSDP, ZeRO-1 state, tensor-parallel
    slices) are `ShardedTensor`s naming their global shape and this rank's boxes. Pass the result to
    `axond.checkpoint.save` / `load`. Unlike `FSDP.state_dict()` (a collective gather), this may be
    called on any subset of ranks.
    """
    model_sd, views = model_views(model)
    return model_sd, (optimizer_views(optimizer, views) if optimizer is not None else None)


def _lookup(tree: dict[str, Any], path: str, what: str) -> Any:
    node: Any = tree
    for key in path.split("/"):
        if not isinstance(node, dict) or key not in node:
            raise CheckpointError(f"set_state_dict: the {what} state has no key {path!r}")
        node = node[key]
    return node


def copy_leaf(dst: Any, src: Any, where: str) -> None:
    """Copy a tensor leaf (array or ShardedTensor) into another with the same global shape, box by box."""
    if dst is src:
        return
    d, s = as_sharded(dst), as_sharded(src)
    if d is None or s is None:
        raise CheckpointError(f"set_state_dict: {where!r} must be an array, got {type(src).__name__}")
    if d.global_shape != s.global_shape:
        raise CheckpointError(f"set_state_dict: {where!r} has shape {s.global_shape}, the model expects {d.global_shape}")
    for dc in d.chunks:
        covered = 0
        for sc in s.chunks:
            if dc.array is sc.array:
                covered += int(np.prod(dc.lengths))
                continue
            inter = intersect((dc.offsets, dc.lengths), (sc.offsets, sc.lengths))
            if inter is None:
                continue
            target = dc.array[local_slices(inter, dc.offsets) + (Ellipsis,)]
            value = sc.array[local_slices(inter, sc.offsets) + (Ellipsis,)]
            if is_cupy_array(target) != is_cupy_array(value):
                value = to_device(value, device_of(target))
            target[...] = value
            covered += int(np.prod(inter[1]))
        if covered < int(np.prod(dc.lengths)):
            raise CheckpointError(f"set_state_dict: the given {where!r} does not cover this rank's part {dc.offsets}+{dc.lengths}")


def _restore(template: Any, value: Any) -> Any:
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def set_state_dict(model: Any, optimizer: Optimizer | None, model_state: dict[str, Any],
                   optim_state: dict[str, Any] | None = None) -> None:
    """Put state (from `get_state_dict` + `load`, or full arrays) back into the model and optimizer.

    Leaves that are the live views already (the usual `load` in place) cost nothing; other arrays
    are copied into this rank's part. Missing keys are refused by name. No communication.
    """
    live, views = model_views(model)
    for key, leaf in live.items():
        copy_leaf(leaf, _lookup(model_state, key, "model"), f"model/{key}")
    if optimizer is None:
        return
    if optim_state is None:
        raise CheckpointError("set_state_dict got an optimizer but no optimizer state")
    live_optim = optimizer_views(optimizer, views)
    for path, leaf in iter_leaves(live_optim["state"]):
        if as_sharded(leaf) is not None:
            copy_leaf(leaf, _lookup(optim_state, f"state/{path}", "optimizer"), f"optim/state/{path}")
    for st, _, pviews in _entries(optimizer, views):
        given = _lookup(optim_state, f"state/{pviews[0].names[0]}", "optimizer") if pviews else {}
        for key, value in list(st.items()):
            if not is_array(value):
                if key not in given:
                    raise CheckpointError(f"set_state_dict: the optimizer state has no key 'state/{pviews[0].names[0]}/{key}'")
                st[key] = _restore(value, given[key])
    defaults = optim_state.get("defaults", {})
    for key, value in defaults.items():
        if key in optimizer.defaults:
            optimizer.defaults[key] = _restore(optimizer.defaults[key], value)
