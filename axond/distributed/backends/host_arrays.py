"""Checks shared by the backends that take NumPy arrays (tcp, mock): inputs and caller-given outputs."""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_array(x: Any, what: str, backend: str) -> np.ndarray:
    """`x` if it is a NumPy array, else a TypeError naming `what` and the backend (and the fix for CuPy)."""
    if not isinstance(x, np.ndarray):
        kind = type(x).__module__.split(".")[0]
        hint = " (CuPy arrays need backend='nccl')" if kind == "cupy" else ""
        raise TypeError(f"{what} must be a NumPy array for the {backend} backend, got {type(x).__name__}{hint}")
    return x


def output_array(out: Any, shape: tuple[int, ...], dtype: np.dtype, op: str, backend: str) -> np.ndarray:
    """A fresh array of `shape`/`dtype`, or the caller's `out=` after checking it can take the result in place."""
    if out is None:
        return np.empty(shape, dtype)
    out = numpy_array(out, f"{op} out", backend)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{op} out= must be a C-contiguous {dtype} array of shape {shape}; "
                         f"got {out.dtype} {out.shape}")
    return out


def scatter_rows(x: np.ndarray, size: int, op: str) -> int:
    """Rows of `x` each member gets in `op` (reduce_scatter): its first dimension must divide by `size`."""
    if x.ndim == 0 or x.shape[0] % size:
        raise ValueError(f"{op} needs x.shape[0] divisible by the group size {size}; "
                         f"got shape {x.shape} (pad the first dimension)")
    return int(x.shape[0] // size)
