"""torch tensors as arguments of axond's own collectives (`axond.all_reduce(t)`), via NumPy views.

Contiguous CPU tensors are passed as views (zero-copy, in place); non-contiguous and bfloat16 ones
go through a staging copy written back after the op (bfloat16 reduces in float32, rounded once).
Array results come back as tensors sharing the array's memory. An async op with a staged tensor
completes before returning (the copy-back needs the result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from axond.distributed.work import Work
from axond.torch.reduce_ops import axond_op
from axond.torch.tensors import Staged, from_numpy, stage

REDUCING = {"all_reduce", "reduce", "reduce_scatter"}
"""Ops whose arithmetic needs bfloat16 widened to float32 (the others move bits)."""


def call_with_tensors(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call `fn` with NumPy views of the torch tensors in `args`/`kwargs`; copy back; tensors out."""
    reduce = fn.__name__ in REDUCING
    staged: list[Staged] = []
    dtypes: list[torch.dtype] = []

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            s = stage(value, f"{fn.__name__} argument", reduce=reduce)
            staged.append(s)
            dtypes.append(value.dtype)
            return s.array
        if isinstance(value, dist.ReduceOp) or type(value).__name__ == "RedOpType":
            return axond_op(value, fn.__name__)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(convert(v) for v in value)
        return value

    result = fn(*(convert(a) for a in args), **{k: convert(v) for k, v in kwargs.items()})
    copies = [s for s in staged if s.stand_in is not None]
    if isinstance(result, Work):
        if copies:
            result.wait()
            for s in copies:
                s.write_back()
        return result
    for s in copies:
        s.write_back()
    return _tensor(result, dtypes[0] if dtypes else None)


def _tensor(result: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(result, np.ndarray) and dtype is not None:
        return from_numpy(result, dtype)
    return result
