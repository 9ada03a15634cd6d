"""A small pre-norm transformer block: causal multi-head self-attention and a GELU MLP.

Q, K and V are separate `Linear`s (heads split along their output features) and the attention
core is a pair of plain functions, so a tensor-parallel wrapper can shard heads column-wise and
the output projection row-wise without touching the math here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from axond.nn.activations import GELU, Dropout
from axond.nn.device import Array, array_module
from axond.nn.linear import Linear
from axond.nn.module import Module, require_ctx
from axond.nn.norm import LayerNorm


def causal_attention_forward(q: Array, k: Array, v: Array) -> tuple[Array, Array]:
    """softmax(q k^T / sqrt(d) + causal mask) v for (B, H, T, D) inputs; returns (out, probs)."""
    xp = array_module(q)
    t = q.shape[-2]
    scores = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    future = xp.triu(xp.ones((t, t), dtype=bool), k=1)
    scores[..., future] = -xp.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v, probs


def causal_attention_backward(grad_out: Array, q: Array, k: Array, v: Array, probs: Array) -> tuple[Array, Array, Array]:
    """Gradients (dq, dk, dv) of `causal_attention_forward` given d out and the saved probabilities."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = probs.swapaxes(-1, -2) @ grad_out
    dprobs = grad_out @ v.swapaxes(-1, -2)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    dq = (dscores @ k) * scale
    dk = (dscores.swapaxes(-1, -2) @ q) * scale
    return dq, dk, dv


def split_heads(x: Array, n_heads: int) -> Array:
    """(B, T, H*D) -> (B, H, T, D)."""
    b, t, c = x.shape
    return x.reshape(b, t, n_heads, c // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x: Array) -> Array:
    """(B, H, T, D) -> (B, T, H*D)."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


class CausalSelfAttention(Module):
    """Multi-head causal self-attention on (batch, time, d_model) inputs."""

    def __init__(self, d_model: int, n_heads: int, *, dtype: Any = np.float32, rng: np.random.Generator | None = None) -> None:
        super().__init__()
        if n_heads <= 0 or d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.q_proj: Module = Linear(d_model, d_model, dtype=dtype, rng=rng)
        self.k_proj: Module = Linear(d_model, d_model, dtype=dtype, rng=rng)
        self.v_proj: Module = Linear(d_model, d_model, dtype=dtype, rng=rng)
        self.out_proj: Module = Linear(d_model, d_model, dtype=dtype, rng=rng)

    def forward(self, x: Array) -> Array:
        if x.ndim != 3:
            raise ValueError(f"CausalSelfAttention expects (batch, time, d_model) inputs, got shape {tuple(x.shape)}")
        heads = self._heads()
        q = split_heads(self.q_proj(x), heads)
        k = split_heads(self.k_proj(x), heads)
        v = split_heads(self.v_proj(x), heads)
        out, probs = causal_attention_forward(q, k, v)
        self._ctx = (q, k, v, probs)
        return self.out_proj(merge_heads(out))

    def _heads(self) -> int:
        """Heads this module computes (all of them here; a tensor-parallel subclass computes its share)."""
        return self.n_heads

    def backward(self, grad_out: Array) -> Array:
        q, k, v, probs = require_ctx(self)
        self._ctx = None
        heads = q.shape[1]
        dout = split_heads(self.out_proj.backward(grad_out), heads)
        dq, dk, dv = causal_attention_backward(dout, q, k, v, probs)
        dx = self.v_proj.backward(merge_heads(dv))
        dx += self.k_proj.backward(merge_heads(dk))
        dx += self.q_proj.backward(merge_heads(dq))
        return dx

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}"


class MLP(Module):
    """fc2(GELU(fc1(x))) with a hidden size of `hidden` features."""

    def __init__(self, d_model: int, hidden: int, *, dtype: Any = np.float32, rng: np.random.Generator | None = None) -> None:
        super().__init__()
        self.fc1 = Linear(d_model, hidden, dtype=dtype, rng=rng)
        self.act = GELU()
        self.fc2 = Linear(hidden, d_model, dtype=dtype, rng=rng)

    def forward(self, x: Array) -> Array:
        return self.fc2(self.act(self.fc1(x)))

    def backward(self, grad_out: Array) -> Array:
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)))


class TransformerBlock(Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)) (pre-norm, as in GPT-2), with optional residual dropout."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        *,
        dtype: Any = np.float32,
        rng: np.random.Generator | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, dtype=dtype, rng=rng)
        self.drop1 = Dropout(dropout, seed=seed)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp: Module = MLP(d_model, mlp_ratio * d_model, dtype=dtype, rng=rng)
        self.drop2 = Dropout(dropout, seed=seed + 1)

    def forward(self, x: Array) -> Array:
        h = x + self.drop1(self.attn(self.ln1(x)))
        return h + self.drop2(self.mlp(self.ln2(h)))

    def backward(self, grad_out: Array) -> Array:
        dh = grad_out + self.ln2.backward(self.mlp.backward(self.drop2.backward(grad_out)))
        return dh + self.ln1.backward(self.attn.backward(self.drop1.backward(dh)))
