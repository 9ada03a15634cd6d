"""In-place NumPy reductions for each `ReduceOp`, and which dtypes each one accepts.

AVG is a SUM followed by a true division by the group size, on floating-point and complex arrays.
AVG on integers is refused (an integer array cannot hold the mean; torch's gloo refuses AVG too):
use SUM and divide, or a float dtype. Integer sums wrap on overflow, like NumPy. On bool, SUM and
MAX are logical or, PRODUCT and MIN logical and; AVG on bool is refused. BAND, BOR and BXOR are
bitwise, on integer and bool arrays only (as in torch's gloo).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.numerics.bf16 import is_bfloat16
from axond.distributed.numerics.reduce_op import BITWISE, ReduceOp

Reducer = Callable[..., np.ndarray]

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)


def wide_dtype(dtype: np.dtype) -> np.dtype | None:
    """The wider dtype a low-precision dtype's SUM/AVG/PRODUCT runs in (rounded once, at the end): float32 for
    float16 and bfloat16 (`axond.distributed.numerics.bf16`); None for the others."""
    return FLOAT32 if dtype == FLOAT16 or is_bfloat16(dtype) else None

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def check_reduce_op(op: ReduceOp, dtype: np.dtype) -> ReduceOp:
    """Validate `op` for `dtype`; accepts ReduceOp members or their names ("sum", "AVG")."""
    if type(op) is ReduceOp and (((dtype.kind == "f" or is_bfloat16(dtype)) and op not in BITWISE)
                                 or (dtype.kind in "iu" and op is not ReduceOp.AVG)):
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
    if op is ReduceOp.AVG and dtype.kind in "iu":
        raise TypeError(f"ReduceOp.AVG is refused on integer arrays ({dtype}): the mean does not fit in them; "
                        "reduce with ReduceOp.SUM and divide the result yourself, or use a float dtype")
    if dtype.kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"ReduceOp.{op.name} is undefined on complex arrays ({dtype})")
    if op in BITWISE and dtype.kind not in "biu":
        raise TypeError(f"ReduceOp.{op.name} is bitwise: defined on integer and bool arrays only, not {dtype}; "
                        "view the data as an integer dtype of the same width (x.view(np.uint32)) to combine the bits")
    return op


def accumulator(dtype: np.dtype, op: ReduceOp) -> np.dtype | None:
    """The dtype a reduction of `dtype` with `op` accumulates in when it is not `dtype` itself, else None."""
    if op is ReduceOp.MIN or op is ReduceOp.MAX or op in BITWISE:
        return None
    return wide_dtype(dtype)


def narrow_into(x: np.ndarray, wide: np.ndarray) -> None:
    """Round the accumulated `wide` result once into `x` (in place; round to nearest even)."""
    np.copyto(x, wide.reshape(x.shape), casting="unsafe")


def finish_average(x: np.ndarray, size: int) -> None:
    """Divide a summed array by `size` in place (AVG; `check_reduce_op` refused integer arrays)."""
    np.true_divide(x, size, out=x)
