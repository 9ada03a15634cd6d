"""Layers with weights: `Linear` (y = x W^T + b, any leading dims) and `Embedding` (row lookup)."""

from __future__ import annotations

from typing import Any

import numpy as np

from axond.nn import init
from axond.nn.device import Array, array_module, scatter_add
from axond.nn.module import Module, Parameter, require_ctx
from axond.nn.precision import narrow, widen


class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out_features, in_features) as in torch."""

    weight: Parameter
    bias: Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = np.float32,
        rng: np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear needs positive sizes, got in_features={in_features}, out_features={out_features}")
        self.in_features = in_features
        self.out_features = out_features
        bound = init.linear_bound(in_features)
        self.weight = Parameter(init.uniform((out_features, in_features), -bound, bound, dtype, rng))
        self.bias = Parameter(init.uniform((out_features,), -bound, bound, dtype, rng)) if bias else None

    def forward(self, x: Array) -> Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects inputs with last dim {self.in_features}, got shape {tuple(x.shape)}")
        self._ctx = x
        w = self.weight.data
        y = widen(x) @ widen(w).T  # low precision: float32 accumulation, one rounding below
        if self.bias is not None:
            y += self.bias.data
        return narrow(y, x.dtype)

    def backward(self, grad_out: Array) -> Array:
        x = require_ctx(self)
        w = self.weight.data
        g2 = widen(grad_out.reshape(-1, self.out_features))
        self.weight.accumulate_grad(narrow(g2.T @ widen(x.reshape(-1, self.in_features)), w.dtype))
        if self.bias is not None:
            self.bias.accumulate_grad(narrow(g2.sum(axis=0), self.bias.data.dtype))
        self._ctx = None
        return narrow(widen(grad_out) @ widen(w), grad_out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Rows of `weight` (num_embeddings, embedding_dim) looked up by integer index; N(0, 1) init."""

    weight: Parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: Any = np.float32,
        rng: np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"Embedding needs positive sizes, got {num_embeddings} x {embedding_dim}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = Parameter(init.normal((num_embeddings, embedding_dim), 0.0, 1.0, dtype, rng))

    def forward(self, x: Array) -> Array:
        xp = array_module(x)
        if x.dtype.kind not in "iu":
            raise TypeError(f"Embedding expects integer indices, got dtype {x.dtype}")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.num_embeddings):
            raise IndexError(f"Embedding indices must lie in [0, {self.num_embeddings}), got [{int(x.min())}, {int(x.max())}]")
        self._ctx = x
        return xp.take(self.weight.data, x, axis=0)

    def backward(self, grad_out: Array) -> None:
        idx = require_ctx(self)
        if self.weight.requires_grad:
            xp = array_module(grad_out)
            grad = xp.zeros_like(self.weight.data)
            scatter_add(xp, grad, idx.reshape(-1), grad_out.reshape(-1, self.embedding_dim))
            self.weight.accumulate_grad(grad)
        self._ctx = None
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
