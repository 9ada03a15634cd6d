"""Low-precision compute: layers given bfloat16/float16 arrays keep that dtype but accumulate in float32.

NumPy has no bfloat16 matmul kernel (ml_dtypes' is ~2x slower than float32 and float16's far slower),
and sums of many low-precision terms lose the bits float32 keeps: matmuls and norm statistics widen
their operands to float32, compute there, and round the result once to the input's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from axond.distributed.numerics.bf16 import is_bfloat16
from axond.nn.device import Array

FLOAT16 = np.dtype(np.float16)
ACCUMULATE = np.dtype(np.float32)


def is_low(dtype: Any) -> bool:
    """Whether `dtype` is a low-precision float that accumulates in float32: float16 or bfloat16."""
    dtype = np.dtype(dtype)
    return dtype == FLOAT16 or is_bfloat16(dtype)


def widen(a: Array) -> Array:
    """`a` in float32 if it is low precision (a new array), else `a` itself."""
    return a.astype(ACCUMULATE) if is_low(a.dtype) else a


def narrow(a: Array, dtype: Any) -> Array:
    """`a` rounded to `dtype` if that is low precision (round to nearest even), else `a` itself."""
    return a.astype(dtype) if is_low(dtype) and a.dtype != dtype else a
