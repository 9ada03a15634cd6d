"""Deterministic initialisation: every draw comes from a seeded NumPy generator, on the CPU, in float64.

Drawing on the CPU and casting afterwards makes a model built from the same seed identical on
every rank and on every device. Layers take `rng=`; without it they use the default generator
that `manual_seed` reseeds.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

_lock = threading.Lock()
_default = np.random.default_rng(0)


def manual_seed(seed: int) -> np.random.Generator:
    """Reseed (and return) the default generator layers use when given no `rng`."""
    global _default
    with _lock:
        _default = np.random.default_rng(seed)
        return _default


def default_generator() -> np.random.Generator:
    """The generator layers use when given no `rng`."""
    return _default


def _rng(rng: np.random.Generator | None) -> np.random.Generator:
    return rng if rng is not None else _default


def uniform(shape: tuple[int, ...], low: float, high: float, dtype: Any, rng: np.random.Generator | None = None) -> np.ndarray:
    """An array of U(low, high) draws."""
    with _lock:
        values = _rng(rng).uniform(low, high, size=shape)
    return values.astype(dtype, copy=False)


def normal(shape: tuple[int, ...], mean: float, std: float, dtype: Any, rng: np.random.Generator | None = None) -> np.ndarray:
    """An array of N(mean, std^2) draws."""
    with _lock:
        values = _rng(rng).normal(mean, std, size=shape)
    return values.astype(dtype, copy=False)


def linear_bound(fan_in: int) -> float:
    """The U(-b, b) bound torch uses for Linear weights and biases: 1 / sqrt(fan_in)."""
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


def xavier_uniform(shape: tuple[int, int], dtype: Any, gain: float = 1.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """Glorot uniform for an (out, in) weight."""
    fan_out, fan_in = shape
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform(shape, -bound, bound, dtype, rng)
