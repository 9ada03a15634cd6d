"""Gradient clipping by the norm of the whole model's gradient when ranks hold different parts of it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.nn.device import Array, array_module
from axond.nn.module import Module, Parameter
from axond.checkpoint.adapters import tp_boxes


def _sum_squares(grads: Sequence[Array]) -> float:
    return sum(float((array_module(g).abs(g).astype(np.float64) ** 2).sum()) for g in grads)


def clip_partitioned(own: Sequence[Parameter], shared: Sequence[Parameter], group: ProcessGroup, max_norm: float) -> float:
    """Clip so that the global 2-norm is at most `max_norm`; returns the norm before clipping (the same on every rank).

    `own`: parameters whose gradients differ per rank and together make the model's (pipeline
    stages, tensor-parallel slices): their squares are summed over `group`. `shared`: parameters
    every rank holds the same copy of (counted once).
    """
    part = np.array([_sum_squares([p.grad for p in own if p.grad is not None])], np.float64)
    if group.size > 1:
        group.all_reduce(part, op=ReduceOp.SUM)
    total = math.sqrt(float(part[0]) + _sum_squares([p.grad for p in shared if p.grad is not None]))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in (*own, *shared):
            if p.grad is not None:
                p.grad *= coef
    return total


def tensor_parallel_split(model: Module) -> tuple[list[Parameter], list[Parameter]]:
    """(sliced, replicated) parameters of a model built from tensor-parallel layers."""
    sliced = set(tp_boxes(model))
    own: list[Parameter] = []
    shared: list[Parameter] = []
    for name, p in model.named_parameters():
        (own if name in sliced else shared).append(p)
    return own, shared
