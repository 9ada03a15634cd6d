"""Low-precision compute: layers given bfloat16/float16 arrays keep that dtype but accumulate in float32.

NumPy has no bfloat16 matmul kernel (ml_dtypes' is ~2x slower than float32 and float16's far slower),
and sums of many low-precision terms lose the bits float32 keeps: matmuls and norm statistics widen
their operands to float32, compute there, and round the result once to the input's dtype.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from axond.nn.device import Array

LOW_PRECISION = frozenset({np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)})
"""Dtypes that compute through float32."""
ACCUMULATE = np.dtype(np.float32)


def is_low(dtype: Any) -> bool:
    """Whether `dtype` is a low-precision float that accumulates in float32."""
    return np.dtype(dtype) in LOW_PRECISION


def widen(a: Array) -> Array:
    """`a` in float32 if it is low precision (a new array), else `a` itself."""
    return a.astype(ACCUMULATE) if a.dtype in LOW_PRECISION else a


def narrow(a: Array, dtype: Any) -> Array:
    """`a` rounded to `dtype` if that is low precision (round to nearest even), else `a` itself."""
    return a.astype(dtype) if np.dtype(dtype) in LOW_PRECISION and a.dtype != dtype else a
