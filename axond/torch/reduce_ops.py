"""torch's reduce ops as axond's: the mapping every torch collective of the "axond" backend goes through, and
PREMUL_SUM as a multiply before a SUM."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from axond.distributed.numerics.reduce_op import ReduceOp

_OPS = [(dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT), (dist.ReduceOp.MIN, ReduceOp.MIN),
        (dist.ReduceOp.MAX, ReduceOp.MAX), (dist.ReduceOp.AVG, ReduceOp.AVG), (dist.ReduceOp.BAND, ReduceOp.BAND),
        (dist.ReduceOp.BOR, ReduceOp.BOR), (dist.ReduceOp.BXOR, ReduceOp.BXOR)]


_BY_VALUE = {(theirs.op if hasattr(theirs, "op") else theirs).value: ours for theirs, ours in _OPS}
"""torch's RedOpType's value -> axond's op. Ops come by the thousand, and hashing or comparing the (pybind11) enum
itself costs about 1 us each; its `.value` costs 0.1."""


def _known(op: Any) -> ReduceOp | None:
    """axond's op for torch's ReduceOp or RedOpType `op`, if it is one of _OPS."""
    kind = op.op if type(op) is dist.ReduceOp else op
    return _BY_VALUE.get(getattr(kind, "value", None))


def axond_op(op: Any, where: str) -> ReduceOp:
    """The axond ReduceOp of torch's `op`, or a clear error for the ones axond lacks."""
    ours = _known(op)
    if ours is not None:
        return ours
    for theirs, ours in _OPS:
        if op == theirs:
            return ours
    raise ValueError(f"{where}: torch ReduceOp {op} is not supported here (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR "
                     "and BXOR are; the backend also takes PREMUL_SUM)")


def reduction(op: Any, where: str) -> tuple[ReduceOp, float | None]:
    """(axond op, factor to multiply every input by first): PREMUL_SUM(f) is SUM of f * x."""
    ours = _known(op)
    if ours is not None:
        return ours, None
    if getattr(op, "op", op) == dist.ReduceOp.RedOpType.PREMUL_SUM:
        factor = op.factor
        return ReduceOp.SUM, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return axond_op(op, where), None


def premultiplied(x: np.ndarray, factor: float | None, in_place: bool) -> np.ndarray:
    """`x` times `factor` (None: `x` itself); in place only for arrays that are the op's output anyway."""
    if factor is None:
        return x
    if x.dtype.kind not in "fc":
        raise TypeError(f"PREMUL_SUM needs a floating-point tensor, got {x.dtype}")
    if in_place:
        np.multiply(x, x.dtype.type(factor), out=x)
        return x
    return np.multiply(x, x.dtype.type(factor))
