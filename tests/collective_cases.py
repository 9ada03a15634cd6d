"""Inputs and NumPy references shared by the collective contract suites of every backend (tcp, nccl)."""

from __future__ import annotations

import numpy as np

from axond import ReduceOp

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
SHAPES = [(), (0,), (1,), (13,), (4, 7), (1031,), (40_009,)]
"""0-d, empty, one element, primes, 2-D, and one above the small-message threshold (for 4+ byte dtypes)."""


def make(rank: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic per-rank input of small values (exact sums and products in every dtype)."""
    rng = np.random.default_rng([seed, rank, len(shape), int(np.prod(shape))])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    low = 0 if dtype.startswith("uint") else -3
    return rng.integers(low, 4, shape).astype(dtype)


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(inputs)
    dtype = stack.dtype
    if op is ReduceOp.SUM:
        return np.add.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.PRODUCT:
        return np.multiply.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.MIN:
        return np.minimum.reduce(stack, axis=0)
    if op is ReduceOp.MAX:
        return np.maximum.reduce(stack, axis=0)
    total = np.add.reduce(stack, axis=0, dtype=dtype)
    if dtype.kind in "iu":
        return np.floor_divide(total, dtype.type(len(inputs)))
    return np.true_divide(total, len(inputs)).astype(dtype)
