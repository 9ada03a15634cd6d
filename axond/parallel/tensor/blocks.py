"""Tensor-parallel versions of `axond.nn.transformer`'s MLP, attention and block (Megatron layout).

Each draws its weights in the same generator order as its `axond.nn` counterpart, so building
both from the same seed gives this rank the slices of the single-process model; the `from_*`
class methods shard an existing module instead. Inputs and outputs are replicated over the group:
one all-reduce per sub-layer in forward (the row-parallel output) and one in backward (d input).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn.activations import GELU, Dropout
from axond.nn.device import Array
from axond.nn.linear import Linear
from axond.nn.module import Module
from axond.nn.norm import LayerNorm
from axond.nn.transformer import MLP, CausalSelfAttention, TransformerBlock
from axond.parallel.tensor.comm import all_reduce_sum, resolve_group, shard_size
from axond.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(Module):
    """fc2(GELU(fc1(x))): fc1 column-parallel (hidden split, no gather), fc2 row-parallel (reduce)."""

    def __init__(self, d_model: int, hidden: int, group: ProcessGroup | None = None, *, dtype: Any = np.float32,
                 rng: np.random.Generator | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        shard_size(hidden, group, "ParallelMLP hidden")
        self.fc1 = ColumnParallelLinear(d_model, hidden, group=group, dtype=dtype, rng=rng)
        self.act = GELU()
        self.fc2 = RowParallelLinear(hidden, d_model, group=group, input_is_parallel=True, dtype=dtype, rng=rng)

    @classmethod
    def from_mlp(cls, mlp: Module, group: ProcessGroup | None = None) -> ParallelMLP:
        """This rank's shard of an existing `nn.MLP` (weights copied)."""
        if not isinstance(mlp, MLP):
            raise TypeError(f"ParallelMLP.from_mlp takes an axond.nn.MLP, got {type(mlp).__name__}")
        group = resolve_group(group)
        shard_size(mlp.fc1.out_features, group, "ParallelMLP hidden")
        out = cls.__new__(cls)
        Module.__init__(out)
        out.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group)
        out.act = GELU()
        out.fc2 = RowParallelLinear.from_linear(mlp.fc2, group, input_is_parallel=True)
        return out

    def forward(self, x: Array) -> Array:
        return self.fc2(self.act(self.fc1(x)))

    def backward(self, grad_out: Array) -> Array:
        return self.fc1.backward(self.act.backward(self.fc2.backward(grad_out)))


def _linear(m: Module) -> Linear:
    if not isinstance(m, Linear):
        raise TypeError(f"from_attention shards the nn.Linear projections of a single-process attention, got a "
                        f"{type(m).__name__} (is it already tensor-parallel?)")
    return m


class ParallelCausalSelfAttention(CausalSelfAttention):
    """`nn.CausalSelfAttention` with the heads split over the group.

    Q, K and V are column-parallel (rank r computes heads [r h, (r + 1) h), h = n_heads / N) and
    the output projection row-parallel. Their three partial input gradients are summed and
    all-reduced once. Forward and the local backward are `nn.CausalSelfAttention`'s.
    """

    def __init__(self, d_model: int, n_heads: int, group: ProcessGroup | None = None, *, dtype: Any = np.float32,
                 rng: np.random.Generator | None = None) -> None:
        Module.__init__(self)
        group = resolve_group(group)
        self._check(d_model, n_heads, group)
        self.q_proj = ColumnParallelLinear(d_model, d_model, group=group, reduce_input_grad=False, dtype=dtype, rng=rng)
        self.k_proj = ColumnParallelLinear(d_model, d_model, group=group, reduce_input_grad=False, dtype=dtype, rng=rng)
        self.v_proj = ColumnParallelLinear(d_model, d_model, group=group, reduce_input_grad=False, dtype=dtype, rng=rng)
        self.out_proj = RowParallelLinear(d_model, d_model, group=group, input_is_parallel=True, dtype=dtype, rng=rng)

    def _check(self, d_model: int, n_heads: int, group: ProcessGroup) -> None:
        if n_heads <= 0 or d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
        self.local_heads = shard_size(n_heads, group, "ParallelCausalSelfAttention n_heads")
        self.d_model = d_model
        self.n_heads = n_heads
        self.group = group

    @classmethod
    def from_attention(cls, attn: CausalSelfAttention, group: ProcessGroup | None = None) -> ParallelCausalSelfAttention:
        """This rank's heads of an existing `nn.CausalSelfAttention` (weights copied)."""
        if not isinstance(attn, CausalSelfAttention):
            raise TypeError(f"from_attention takes an axond.nn.CausalSelfAttention, got {type(attn).__name__}")
        out = cls.__new__(cls)
        Module.__init__(out)
        group = resolve_group(group)
        out._check(attn.d_model, attn.n_heads, group)
        out.q_proj = ColumnParallelLinear.from_linear(_linear(attn.q_proj), group, reduce_input_grad=False)
        out.k_proj = ColumnParallelLinear.from_linear(_linear(attn.k_proj), group, reduce_input_grad=False)
        out.v_proj = ColumnParallelLinear.from_linear(_linear(attn.v_proj), group, reduce_input_grad=False)
        out.out_proj = RowParallelLinear.from_linear(_linear(attn.out_proj), group, input_is_parallel=True)
        return out

    def _heads(self) -> int:
        return self.local_heads

    def backward(self, grad_out: Array) -> Array:
        return all_reduce_sum(super().backward(grad_out), self.group)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads} ({self.local_heads} on this rank)"


class ParallelTransformerBlock(TransformerBlock):
    """`nn.TransformerBlock` (pre-norm) with tensor-parallel attention and MLP.

    LayerNorms and dropouts are replicated: their inputs are identical on every rank, so are their
    gradients and (same seed) their masks, and no extra communication is needed.
    """

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0, group: ProcessGroup | None = None,
                 *, dtype: Any = np.float32, rng: np.random.Generator | None = None, seed: int = 0) -> None:
        Module.__init__(self)
        group = resolve_group(group)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = ParallelCausalSelfAttention(d_model, n_heads, group, dtype=dtype, rng=rng)
        self.drop1 = Dropout(dropout, seed=seed)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = ParallelMLP(d_model, mlp_ratio * d_model, group, dtype=dtype, rng=rng)
        self.drop2 = Dropout(dropout, seed=seed + 1)

    @classmethod
    def from_block(cls, block: TransformerBlock, group: ProcessGroup | None = None) -> ParallelTransformerBlock:
        """This rank's shard of an existing `nn.TransformerBlock` (weights copied, no gradients; norms and dropouts copied whole)."""
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"from_block takes an axond.nn.TransformerBlock, got {type(block).__name__}")
        out = cls.__new__(cls)
        Module.__init__(out)
        out.ln1 = copy.deepcopy(block.ln1)
        out.attn = ParallelCausalSelfAttention.from_attention(block.attn, group)
        out.drop1 = copy.deepcopy(block.drop1)
        out.ln2 = copy.deepcopy(block.ln2)
        out.mlp = ParallelMLP.from_mlp(block.mlp, group)
        out.drop2 = copy.deepcopy(block.drop2)
        for replica in (out.ln1, out.ln2, out.drop1, out.drop2):
            replica.zero_grad()
            replica.__dict__["_ctx"] = None
        return out

