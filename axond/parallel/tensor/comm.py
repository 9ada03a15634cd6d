"""The collectives tensor parallelism needs, as four regions with an explicit forward and backward.

Each region is a parameter-free `Module` bound to the tensor-parallel group, the picotron
`tp_communications` functions written for axond's explicit backward:

| region                     | forward                      | backward                     |
|----------------------------|------------------------------|------------------------------|
| `CopyToParallelRegion`     | identity                     | all_reduce(SUM)              |
| `ReduceFromParallelRegion` | all_reduce(SUM)              | identity                     |
| `GatherFromParallelRegion` | all_gather on the last dim   | keep this rank's split       |
| `ScatterToParallelRegion`  | keep this rank's split       | all_gather on the last dim   |

Splits are contiguous: group rank r holds last-dim features [r * n / N, (r + 1) * n / N).
"""

from __future__ import annotations

from axond.distributed.process_group import ProcessGroup
from axond.nn.device import Array, array_module
from axond.nn.module import Module
from axond.distributed import default_registry as defaults


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """`group`, or axond's default group when it is None (a clear error if there is none)."""
    return defaults.or_given(group, "tensor-parallel layers")


def shard_size(total: int, group: ProcessGroup, what: str) -> int:
    """total / group.size, or a ValueError naming both when it does not divide."""
    if total % group.size != 0:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel group size ({group.size}); "
                         f"pick a size that is a multiple of {group.size} or a smaller group")
    return total // group.size


def all_reduce_sum(x: Array, group: ProcessGroup) -> Array:
    """Sum `x` over `group` IN PLACE when `x` is contiguous (pass an array you own); returns the result."""
    if group.size == 1:
        return x
    x = array_module(x).ascontiguousarray(x)
    group.all_reduce(x)
    return x


def split_last_dim(x: Array, group: ProcessGroup) -> Array:
    """This rank's contiguous block of the last dimension (a contiguous copy)."""
    if group.size == 1:
        return x
    width = shard_size(x.shape[-1], group, f"the last dimension of shape {tuple(x.shape)}")
    start = group.rank * width
    return array_module(x).ascontiguousarray(x[..., start : start + width])


def all_gather_first_dim(x: Array, group: ProcessGroup) -> Array:
    """Concatenate every rank's `x` along the first dimension, in group-rank order (a new array)."""
    if group.size == 1:
        return x.copy()
    xp = array_module(x)
    blocks = xp.empty((group.size, *x.shape), dtype=x.dtype)
    group.all_gather(xp.ascontiguousarray(x), out=blocks)
    return blocks.reshape(group.size * x.shape[0], *x.shape[1:])


def all_gather_last_dim(x: Array, group: ProcessGroup) -> Array:
    """Concatenate every rank's `x` along the last dimension, in group-rank order."""
    if group.size == 1:
        return x
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    blocks = xp.empty((group.size, *x.shape), dtype=x.dtype)
    group.all_gather(x, out=blocks)
    return xp.moveaxis(blocks, 0, -2).reshape(*x.shape[:-1], group.size * x.shape[-1])


class _Region(Module):
    """A parameter-free communication step bound to one group."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = resolve_group(group)

    def extra_repr(self) -> str:
        return f"group={getattr(self.group, 'name', '?')}, size={self.group.size}"


class CopyToParallelRegion(_Region):
    """Enter a region where each rank uses the full (replicated) input for its own shard.

    Forward: identity. Backward: all_reduce(SUM), because every rank's shard contributed a part
    of the gradient with respect to the shared input.
    """

    def forward(self, x: Array) -> Array:
        return x

    def backward(self, grad_out: Array) -> Array:
        return all_reduce_sum(grad_out, self.group)


class ReduceFromParallelRegion(_Region):
    """Leave a region whose ranks hold partial sums of the output.

    Forward: all_reduce(SUM) (in place on a contiguous input). Backward: identity, the full
    output's gradient is every partial sum's gradient.
    """

    def forward(self, x: Array) -> Array:
        return all_reduce_sum(x, self.group)

    def backward(self, grad_out: Array) -> Array:
        return grad_out


class GatherFromParallelRegion(_Region):
    """Leave a region whose ranks hold blocks of the last dimension.

    Forward: all_gather along the last dimension. Backward: keep this rank's block of the gradient.
    """

    def forward(self, x: Array) -> Array:
        return all_gather_last_dim(x, self.group)

    def backward(self, grad_out: Array) -> Array:
        return split_last_dim(grad_out, self.group)


class ScatterToParallelRegion(_Region):
    """Enter a region where each rank works on its block of the last dimension.

    Forward: keep this rank's block. Backward: all_gather the blocks' gradients along the last dimension.
    """

    def forward(self, x: Array) -> Array:
        return split_last_dim(x, self.group)

    def backward(self, grad_out: Array) -> Array:
        return all_gather_last_dim(grad_out, self.group)
