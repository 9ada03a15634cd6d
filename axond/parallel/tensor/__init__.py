"""Tensor parallelism (Megatron layout): column/row-parallel linears, the regions they communicate
through, and tensor-parallel MLP, attention and transformer block."""

from axond.parallel.tensor.blocks import ParallelCausalSelfAttention, ParallelMLP, ParallelTransformerBlock
from axond.parallel.tensor.comm import (
    CopyToParallelRegion,
    GatherFromParallelRegion,
    ReduceFromParallelRegion,
    ScatterToParallelRegion,
)
from axond.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "CopyToParallelRegion",
    "GatherFromParallelRegion",
    "ParallelCausalSelfAttention",
    "ParallelMLP",
    "ParallelTransformerBlock",
    "ReduceFromParallelRegion",
    "RowParallelLinear",
    "ScatterToParallelRegion",
]
