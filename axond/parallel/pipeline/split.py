"""Cutting a `Sequential` into contiguous pipeline stages, balanced by parameter count or at given points."""

from __future__ import annotations

from collections.abc import Sequence

from axond.nn.container import Sequential
from axond.nn.module import Module


class Stage(Sequential):
    """Consecutive layers of a `Sequential`, registered under their original indices.

    Keeping the indices keeps parameter names equal to the whole model's ("3.weight"), so a
    stage's `state_dict` and `named_parameters` line up with the unsplit model. Forward and
    backward are `Sequential`'s.
    """

    def __init__(self, layers: Sequence[tuple[str, Module]]) -> None:
        Module.__init__(self)
        if not layers:
            raise ValueError("a pipeline stage needs at least one layer")
        for name, layer in layers:
            setattr(self, name, layer)


def balanced_split_points(weights: Sequence[int], num_stages: int) -> list[int]:
    """Start index of each stage after the first, minimising the heaviest stage (ties: earliest cuts).

    A dynamic programme over contiguous partitions; every stage gets at least one layer.
    """
    n = len(weights)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages; "
                         f"use a model with at least {num_stages} layers or fewer stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for end in range(k, n - (num_stages - k) + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost < best[k][end]:
                    best[k][end] = cost
                    cut[k][end] = start
    points = []
    end = n
    for k in range(num_stages, 0, -1):
        end = cut[k][end]
        points.append(end)
    return sorted(points)[1:]


def split_sequential(model: Sequential, num_stages: int, split_points: Sequence[int] | None = None) -> list[Stage]:
    """Cut `model` into `num_stages` stages: at `split_points` (start index of stages 1..n-1) or balanced.

    Balancing weighs each layer by its parameter count plus one, so parameterless layers still
    spread over stages instead of piling up on one.
    """
    if not isinstance(model, Sequential):
        raise TypeError(f"Pipeline splits an axond.nn.Sequential, got {type(model).__name__}; "
                        f"pass a Sequential or a list of stage modules")
    named = list(model._modules.items())
    if split_points is None:
        weights = [1 + sum(p.size for p in layer.parameters()) for _, layer in named]
        points = balanced_split_points(weights, num_stages)
    else:
        points = [int(p) for p in split_points]
        if len(points) != num_stages - 1:
            raise ValueError(f"{num_stages} stages need {num_stages - 1} split points, got {list(split_points)}")
        if points != sorted(set(points)) or (points and (points[0] < 1 or points[-1] >= len(named))):
            raise ValueError(f"split_points must be strictly increasing indices in [1, {len(named) - 1}] "
                             f"(the first layer of each later stage), got {list(split_points)}")
    bounds = [0, *points, len(named)]
    return [Stage(named[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
