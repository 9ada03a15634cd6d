"""LayerNorm over the last dimension."""

from __future__ import annotations

from typing import Any

import numpy as np

from axond.nn.device import Array, array_module
from axond.nn.module import Module, Parameter, require_ctx
from axond.nn.precision import narrow, widen


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last `normalized_shape` features."""

    weight: Parameter | None
    bias: Parameter | None

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True, *, dtype: Any = np.float32) -> None:
        super().__init__()
        if normalized_shape <= 0:
            raise ValueError(f"LayerNorm needs a positive feature size, got {normalized_shape}")
        self.normalized_shape = normalized_shape
        self.eps = eps
        if elementwise_affine:
            self.weight = Parameter(np.ones(normalized_shape, dtype=dtype))
            self.bias = Parameter(np.zeros(normalized_shape, dtype=dtype))
        else:
            self.weight = None
            self.bias = None

    def forward(self, x: Array) -> Array:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(f"LayerNorm expects last dim {self.normalized_shape}, got shape {tuple(x.shape)}")
        xp = array_module(x)
        dtype, x = x.dtype, widen(x)  # statistics of low-precision inputs in float32
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        var = (centered * centered).mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + self.eps)
        xhat = centered * rstd
        self._ctx = (xhat, rstd)
        if self.weight is not None and self.bias is not None:
            return narrow(xhat * self.weight.data + self.bias.data, dtype)
        return narrow(xhat, dtype)

    def backward(self, grad_out: Array) -> Array:
        xhat, rstd = require_ctx(self)
        self._ctx = None
        n = self.normalized_shape
        dtype, grad_out = grad_out.dtype, widen(grad_out)
        if self.weight is not None and self.bias is not None:
            wdt = self.weight.data.dtype
            self.weight.accumulate_grad(narrow((grad_out * xhat).reshape(-1, n).sum(axis=0), wdt))
            self.bias.accumulate_grad(narrow(grad_out.reshape(-1, n).sum(axis=0), wdt))
            g = grad_out * self.weight.data
        else:
            g = grad_out
        mean_g = g.mean(axis=-1, keepdims=True)
        mean_gx = (g * xhat).mean(axis=-1, keepdims=True)
        return narrow((g - mean_g - xhat * mean_gx) * rstd, dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"
