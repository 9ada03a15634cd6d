"""Element-wise layers: ReLU, GELU (tanh approximation), Tanh, and seeded Dropout."""

from __future__ import annotations

import math

import numpy as np

from axond.nn.device import Array, array_module
from axond.nn.module import Module, require_ctx

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Array) -> Array:
        mask = x > 0
        self._ctx = mask
        return x * mask

    def backward(self, grad_out: Array) -> Array:
        mask = require_ctx(self)
        self._ctx = None
        return grad_out * mask


class GELU(Module):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh approximation (GPT-2's)."""

    def forward(self, x: Array) -> Array:
        xp = array_module(x)
        t = xp.tanh(_GELU_K * (x + _GELU_C * x * x * x))
        self._ctx = (x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_out: Array) -> Array:
        x, t = require_ctx(self)
        self._ctx = None
        dinner = _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
        return grad_out * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Array) -> Array:
        y = array_module(x).tanh(x)
        self._ctx = y
        return y

    def backward(self, grad_out: Array) -> Array:
        y = require_ctx(self)
        self._ctx = None
        return grad_out * (1.0 - y * y)


class Dropout(Module):
    """Zero each element with probability `p` in training mode and scale the rest by 1/(1-p).

    Masks come from this layer's own generator (seeded by `seed`), drawn on the CPU, so a run is
    reproducible and identical on CPU and GPU. In eval mode it is the identity.
    """

    def __init__(self, p: float = 0.5, *, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.seed = seed
        self._gen = np.random.default_rng(seed)

    def reseed(self, seed: int) -> None:
        """Restart the mask sequence from `seed` (e.g. seed + rank for independent ranks)."""
        self.seed = seed
        self._gen = np.random.default_rng(seed)

    def forward(self, x: Array) -> Array:
        if not self.training or self.p == 0.0:
            self._ctx = 1.0
            return x
        xp = array_module(x)
        keep = self._gen.random(x.shape) >= self.p
        scale = xp.asarray(keep, dtype=x.dtype) * (1.0 / (1.0 - self.p))
        self._ctx = scale
        return x * scale

    def backward(self, grad_out: Array) -> Array:
        scale = require_ctx(self)
        self._ctx = None
        return grad_out * scale

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}"
