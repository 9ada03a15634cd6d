"""bfloat16 without importing ml_dtypes at start-up.

NumPy has no bfloat16; ml_dtypes provides it, and importing it takes about 0.6 s of CPU (ml_dtypes 0.7), which every
rank, worker and CLI command would pay at `import axond`. An array of bfloat16 exists only once its creator imported
ml_dtypes, so axond recognises the dtype by its name (`is_bfloat16`, which imports nothing) and imports ml_dtypes
only where it must make the dtype itself (`bfloat16()`: a receive of bfloat16 data, `axond.bfloat16`, a bf16
compression hook).
"""

from __future__ import annotations

import functools

import numpy as np

NAME = "bfloat16"


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16 (imports nothing)."""
    return dtype.kind == "V" and dtype.name == NAME


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 as a NumPy dtype (imports ml_dtypes on the first call)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
