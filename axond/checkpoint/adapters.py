"""How each wrapper holds its parameters, as shards of the unwrapped model's global tensors.

`model_views` returns the model's state dict with every tensor as a view (a plain array when the
rank holds it whole, else a `ShardedTensor`), plus, for each parameter object an optimizer may
hold, how an array laid out like it (its optimizer state) maps to the same global names. Nothing
here communicates: a state dict is a set of views, so `get_state_dict` may run on one rank alone.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from axond.checkpoint.sharded import Chunk, ShardedTensor
from axond.nn.device import Array
from axond.nn.module import Module
from axond.parallel.ddp.ddp import DistributedDataParallel
from axond.parallel.fsdp.fsdp import FullyShardedDataParallel
from axond.parallel.fsdp.flat_param import FlatLayout
from axond.parallel.pipeline.pipeline import Pipeline
from axond.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


@dataclass
class ParamView:
    """Global names of (part of) an optimizer-visible parameter, and how to view an array shaped like it."""

    names: list[str]
    """Every state-dict name of the parameter (the first is the canonical one, used for optimizer state)."""
    to_leaf: Callable[[Array], Any]
    """An array with the parameter's local layout (e.g. its exp_avg) -> the leaf for `names`."""


Views = dict[int, list[ParamView]]
"""id(Parameter) -> the global parameters it holds (several for an FSDP flat shard)."""


def tp_boxes(module: Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (global shape, offsets) of every tensor-parallel parameter slice in `module`."""
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for prefix, m in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(m, ColumnParallelLinear):
            lo = m.group.rank * m.out_local
            out[f"{dot}weight"] = ((m.out_features, m.in_features), (lo, 0))
            if m.bias is not None:
                out[f"{dot}bias"] = ((m.out_features,), (lo,))
        elif isinstance(m, RowParallelLinear):
            out[f"{dot}weight"] = ((m.out_features, m.in_features), (0, m.group.rank * m.in_local))
    return out


def _plain(module: Module, sd: OrderedDict[str, Any], views: Views) -> None:
    """A module whose tensors this rank holds whole, except tensor-parallel slices."""
    boxes = tp_boxes(module)

    def leaf(name: str, array: Array) -> Any:
        if name not in boxes:
            return array
        shape, offsets = boxes[name]
        return ShardedTensor(shape, np.dtype(array.dtype), [Chunk(offsets, array)])

    for key, array in module.state_dict().items():
        sd[key] = leaf(key, array)
    for name, p in module.named_parameters():
        views[id(p)] = [ParamView([name], functools.partial(leaf, name))]


def _flat_views(layout: FlatLayout, rank: int, names: list[list[str]]) -> list[ParamView]:
    """Views of a flat padded shard (FSDP unit or ZeRO bucket): each parameter's part of it, as a flat range."""
    start, stop = layout.shard_range(rank)
    out = []
    for i, shape in enumerate(layout.shapes):
        o, n = layout.offsets[i], layout.numels[i]
        lo, hi = max(start, o), min(stop, o + n)

        def to_leaf(flat: Array, shape: tuple[int, ...] = shape, lo: int = lo, hi: int = hi, o: int = o) -> Any:
            if lo >= hi:
                return ShardedTensor(shape, np.dtype(flat.dtype), [])
            return ShardedTensor.from_flat_range(shape, lo - o, flat[lo - start : hi - start])

        out.append(ParamView(names[i], to_leaf))
    return out


def _fsdp(fsdp: FullyShardedDataParallel, sd: OrderedDict[str, Any], views: Views) -> None:
    sharded: dict[str, Any] = {}
    for u in fsdp.units:
        unit_views = _flat_views(u.layout, u.shard_rank, u.names)
        views[id(u.shard)] = unit_views
        for v in unit_views:
            st = v.to_leaf(u.shard.data)
            for name in v.names:
                sharded[name] = st
    rest: OrderedDict[str, Any] = OrderedDict()
    _plain(fsdp.module, rest, views)
    order = getattr(fsdp, "_state_keys", None) or list(sharded) + list(rest)
    for key in order:
        sd[key] = sharded[key] if key in sharded else rest[key]


def model_views(model: Any) -> tuple[OrderedDict[str, Any], Views]:
    """(the unwrapped model's state dict as views, optimizer-parameter views) for any axond wrapper."""
    sd: OrderedDict[str, Any] = OrderedDict()
    views: Views = {}
    if isinstance(model, Pipeline):
        for stage in model.stages:
            _plain(stage, sd, views)
    elif isinstance(model, FullyShardedDataParallel):
        _fsdp(model, sd, views)
    elif isinstance(model, DistributedDataParallel):
        _plain(model.module, sd, views)
    elif isinstance(model, Module):
        _plain(model, sd, views)
    else:
        raise TypeError(f"get_state_dict takes an axond.nn.Module, DDP, FSDP or Pipeline, got {type(model).__name__}")
    return sd, views
