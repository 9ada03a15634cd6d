"""In-place NumPy reductions for each `ReduceOp`, and which dtypes each one accepts.

AVG is a SUM followed by a division by the group size: floats use true division; integers use
floor division (rounding toward minus infinity, like `np.floor_divide`) after summing in the
array's own dtype (wrapping on overflow, like NumPy). On bool, SUM and MAX are logical or,
PRODUCT and MIN logical and; AVG on bool is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.reduce_op import ReduceOp

Reducer = Callable[..., np.ndarray]

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def check_reduce_op(op: ReduceOp, dtype: np.dtype) -> ReduceOp:
    """Validate `op` for `dtype`; accepts ReduceOp members or their names ("sum", "AVG")."""
    if type(op) is ReduceOp and dtype.kind in "fiu":
        return op
    if isinstance(op, str):
        try:
            op = ReduceOp[op.upper()]
        except KeyError as e:
            raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name for o in ReduceOp]}") from e
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be an axond.ReduceOp, got {op!r}")
    if op is ReduceOp.AVG and dtype == np.bool_:
        raise TypeError("ReduceOp.AVG is undefined on bool arrays; use SUM (logical or) or cast to a number first")
    if dtype.kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"ReduceOp.{op.name} is undefined on complex arrays ({dtype})")
    return op


def finish_average(x: np.ndarray, size: int) -> None:
    """Divide a summed array by `size` in place (floor division on integers)."""
    if x.dtype.kind in "iu":
        np.floor_divide(x, x.dtype.type(size), out=x)
    else:
        np.true_divide(x, size, out=x)
