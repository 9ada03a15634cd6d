"""`ColumnParallelLinear` and `RowParallelLinear`: one `Linear` split over a tensor-parallel group.

Initialisation draws the FULL weight and bias exactly as `nn.Linear(in, out, rng=rng)` does
(same generator calls, same order) and keeps this rank's slice, so a layer built with the same
seed on every rank holds the slices of the one `Linear` built with that seed. That costs one full
weight per rank during construction (freed afterwards); `from_linear` shards an existing layer.
Every rank must pass an identically seeded `rng` (the default generator is shared by threads).
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn import init
from axond.nn.device import Array
from axond.nn.linear import Linear
from axond.nn.module import Module, Parameter, require_ctx
from axond.parallel.tensor.comm import (
    all_gather_first_dim,
    all_gather_last_dim,
    all_reduce_sum,
    resolve_group,
    shard_size,
    split_last_dim,
)

_L = TypeVar("_L", bound="_ParallelLinear")


def _check_positive(in_features: int, out_features: int) -> None:
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"a parallel Linear needs positive sizes, got in_features={in_features}, "
                         f"out_features={out_features}")


def _full_init(in_features: int, out_features: int, bias: bool, dtype: Any,
               rng: np.random.Generator | None) -> tuple[Array, Array | None]:
    """The weight and bias `nn.Linear(in_features, out_features, bias, dtype=dtype, rng=rng)` would draw."""
    bound = init.linear_bound(in_features)
    weight = init.uniform((out_features, in_features), -bound, bound, dtype, rng)
    b = init.uniform((out_features,), -bound, bound, dtype, rng) if bias else None
    return weight, b


class _ParallelLinear(Module):
    """What both parallel linears share: sizes, the group, and building from full arrays."""

    weight: Parameter
    bias: Parameter | None

    def _init_from_rng(self, in_features: int, out_features: int, bias: bool, dtype: Any,
                       rng: np.random.Generator | None) -> None:
        """Check the sizes, draw the full `nn.Linear` initialisation and keep this rank's slices."""
        self._check_sizes(in_features, out_features)
        self._build(in_features, out_features, *_full_init(in_features, out_features, bias, dtype, rng))

    def _check_sizes(self, in_features: int, out_features: int) -> None:
        """Raise ValueError unless the sizes are positive and the sharded one divides by the group size."""
        raise NotImplementedError

    def _shard(self, full_weight: Array, full_bias: Array | None) -> tuple[Array, Array | None]:
        """This rank's (weight, bias) slices (views) of the full arrays; `_build` copies them."""
        raise NotImplementedError

    def _build(self, in_features: int, out_features: int, full_weight: Array, full_bias: Array | None) -> None:
        self.in_features = in_features
        self.out_features = out_features
        w, b = self._shard(full_weight, full_bias)
        self.weight = Parameter(w.copy())
        self.bias = Parameter(b.copy()) if b is not None else None

    @classmethod
    def _blank(cls: type[_L], group: ProcessGroup | None) -> _L:
        """An empty layer bound to `group`, for `from_linear` (no random draws)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer.group = resolve_group(group)
        return layer

    def _load_linear(self, linear: Linear) -> None:
        """Keep this rank's slices of `linear`'s weight and bias (copies)."""
        if not isinstance(linear, Linear):
            raise TypeError(f"{type(self).__name__}.from_linear takes an axond.nn.Linear, got {type(linear).__name__}")
        self._check_sizes(linear.in_features, linear.out_features)
        full_b = linear.bias.data if linear.bias is not None else None
        self._build(linear.in_features, linear.out_features, linear.weight.data, full_b)

    def _gather_weight(self) -> Array:
        raise NotImplementedError

    def _gather_bias(self) -> Array | None:
        raise NotImplementedError

    def to_linear(self) -> Linear:
        """The full `nn.Linear` on every rank (a collective over the group: every rank must call it)."""
        weight = self._gather_weight()
        bias = self._gather_bias()
        full = Linear(self.in_features, self.out_features, bias=bias is not None, dtype=weight.dtype,
                      rng=np.random.default_rng(0))
        full.weight.data = weight
        if full.bias is not None:
            full.bias.data = bias
        return full

    def _local_param_grads(self, grad_out: Array, x: Array) -> None:
        """Accumulate d weight = g^T x and d bias = sum g over every leading dimension."""
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        self.weight.accumulate_grad(g2.T @ x.reshape(-1, x.shape[-1]))
        if self.bias is not None:
            self.bias.accumulate_grad(g2.sum(axis=0))


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's OUTPUT features split: group rank r holds rows [r k, (r + 1) k), k = out / N.

    forward: the input is replicated; y_local = x W_r^T + b_r, or the full y (all_gather on the
    last dim) when `gather_output=True`. backward: parameter gradients stay local; d x is each
    rank's partial sum, all-reduced over the group (the copy-to-region backward) unless
    `reduce_input_grad=False`, for callers that sum several column layers' d x and reduce it once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: ProcessGroup | None = None, *,
                 gather_output: bool = False, reduce_input_grad: bool = True, dtype: Any = np.float32,
                 rng: np.random.Generator | None = None) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self._set_options(gather_output, reduce_input_grad)
        self._init_from_rng(in_features, out_features, bias, dtype, rng)

    @classmethod
    def from_linear(cls, linear: Linear, group: ProcessGroup | None = None, *, gather_output: bool = False,
                    reduce_input_grad: bool = True) -> ColumnParallelLinear:
        """This rank's output-feature slice of an existing `nn.Linear` (weights copied)."""
        layer = cls._blank(group)
        layer._set_options(gather_output, reduce_input_grad)
        layer._load_linear(linear)
        return layer

    def _set_options(self, gather_output: bool, reduce_input_grad: bool) -> None:
        self.gather_output = gather_output
        self.reduce_input_grad = reduce_input_grad

    def _check_sizes(self, in_features: int, out_features: int) -> None:
        _check_positive(in_features, out_features)
        self.out_local = shard_size(out_features, self.group, "ColumnParallelLinear out_features")

    def _shard(self, full_weight: Array, full_bias: Array | None) -> tuple[Array, Array | None]:
        lo = self.group.rank * self.out_local
        hi = lo + self.out_local
        return full_weight[lo:hi], (full_bias[lo:hi] if full_bias is not None else None)

    def _gather_weight(self) -> Array:
        return all_gather_first_dim(self.weight.data, self.group)

    def _gather_bias(self) -> Array | None:
        return all_gather_first_dim(self.bias.data, self.group) if self.bias is not None else None

    def forward(self, x: Array) -> Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear expects inputs with last dim {self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        self._ctx = x
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return all_gather_last_dim(y, self.group) if self.gather_output else y

    def backward(self, grad_out: Array) -> Array:
        x = require_ctx(self)
        self._ctx = None
        if self.gather_output:
            grad_out = split_last_dim(grad_out, self.group)
        self._local_param_grads(grad_out, x)
        grad_in = grad_out @ self.weight.data
        return all_reduce_sum(grad_in, self.group) if self.reduce_input_grad else grad_in

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_local} on this rank), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, tp={self.group.size}")


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's INPUT features split: group rank r holds columns [r k, (r + 1) k), k = in / N.

    forward: partial = x_r W_r^T, all_reduce(SUM), then + b (the full bias, added once after the
    reduce). With `input_is_parallel=False` the full input comes in and each rank first keeps its
    block of the last dim. backward: d x_r = g W_r stays local (all-gathered back to the full
    input's shape when `input_is_parallel=False`); d W_r local; d b is the full, identical
    gradient on every rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: ProcessGroup | None = None, *,
                 input_is_parallel: bool = True, dtype: Any = np.float32,
                 rng: np.random.Generator | None = None) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self._set_options(input_is_parallel)
        self._init_from_rng(in_features, out_features, bias, dtype, rng)

    @classmethod
    def from_linear(cls, linear: Linear, group: ProcessGroup | None = None, *, input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's input-feature slice of an existing `nn.Linear` (weights copied)."""
        layer = cls._blank(group)
        layer._set_options(input_is_parallel)
        layer._load_linear(linear)
        return layer

    def _set_options(self, input_is_parallel: bool) -> None:
        self.input_is_parallel = input_is_parallel

    def _check_sizes(self, in_features: int, out_features: int) -> None:
        _check_positive(in_features, out_features)
        self.in_local = shard_size(in_features, self.group, "RowParallelLinear in_features")

    def _shard(self, full_weight: Array, full_bias: Array | None) -> tuple[Array, Array | None]:
        lo = self.group.rank * self.in_local
        return full_weight[:, lo : lo + self.in_local], full_bias

    def _gather_weight(self) -> Array:
        return all_gather_last_dim(self.weight.data, self.group)

    def _gather_bias(self) -> Array | None:
        return self.bias.data.copy() if self.bias is not None else None

    def forward(self, x: Array) -> Array:
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"RowParallelLinear(input_is_parallel=False) expects the full input with last dim "
                                 f"{self.in_features}, got shape {tuple(x.shape)}")
            x = split_last_dim(x, self.group)
        elif x.shape[-1] != self.in_local:
            raise ValueError(f"RowParallelLinear expects this rank's input block with last dim {self.in_local} "
                             f"(in_features {self.in_features} / {self.group.size} ranks), got shape {tuple(x.shape)}; "
                             f"pass input_is_parallel=False to give it the full input")
        self._ctx = x
        y = all_reduce_sum(x @ self.weight.data.T, self.group)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_out: Array) -> Array:
        x = require_ctx(self)
        self._ctx = None
        self._local_param_grads(grad_out, x)
        grad_in = grad_out @ self.weight.data
        return grad_in if self.input_is_parallel else all_gather_last_dim(grad_in, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_local} on this rank), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, tp={self.group.size}")
