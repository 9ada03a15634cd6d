"""The collectives FSDP and ZeRO need, each on a flat buffer cut into equal shards.

`all_gather_shards` is the forward of sharding (every rank's shard -> the full flat buffer) and
`reduce_scatter_shards` its backward (every rank's full gradient -> this rank's averaged shard):
they are each other's adjoint. `all_reduce_mean` averages a replicated gradient (NO_SHARD, and the
replicate dimension of HYBRID_SHARD); `broadcast_from_first` makes every rank start equal.
"""

from __future__ import annotations

from typing import Any, Protocol

from axond.distributed.numerics.reduce_op import ReduceOp
from axond.nn.device import Array
from axond.distributed import default_registry as defaults


class GroupLike(Protocol):
    """What FSDP needs of a process group (an `axond.distributed.ProcessGroup`)."""

    rank: int
    size: int

    def all_gather(self, x: Array, async_op: bool = ..., out: Array | None = ...) -> Any: ...

    def reduce_scatter(self, x: Array, op: ReduceOp = ..., async_op: bool = ..., out: Array | None = ...) -> Any: ...

    def all_reduce(self, x: Array, op: ReduceOp = ..., async_op: bool = ...) -> Any: ...

    def broadcast(self, x: Array, src: int = ..., async_op: bool = ...) -> Any: ...


def all_gather_shards(shard: Array, full: Array, group: GroupLike, async_op: bool = False) -> Any:
    """Fill `full` (group.size * shard.size elements) with every rank's `shard`, rank order.

    Forward: concatenation of the shards. Backward: `reduce_scatter_shards` (each rank's block of the
    summed or averaged full gradient). With `async_op`, returns the `Work` (wait before reading `full`).
    """
    n = shard.size
    if full.size != n * group.size:
        raise ValueError(f"all_gather_shards: full buffer of {full.size} elements != {group.size} shards x {n}")
    return group.all_gather(shard.reshape(n), async_op=async_op, out=full.reshape(group.size, n))


def reduce_scatter_shards(full: Array, shard_out: Array, group: GroupLike, async_op: bool = False) -> Any:
    """Average `full` over the group and write this rank's block into `shard_out` (in place).

    Forward: shard of the mean of every rank's full gradient. Backward: `all_gather_shards`.
    With `async_op`, returns the `Work` (keep `full` alive and wait before reading `shard_out`).
    """
    n = shard_out.size
    if full.size != n * group.size:
        raise ValueError(f"reduce_scatter_shards: full buffer of {full.size} elements != {group.size} shards x {n}")
    return group.reduce_scatter(full.reshape(group.size, n), ReduceOp.AVG, async_op=async_op,
                                out=shard_out.reshape(1, n))


def all_reduce_mean(x: Array, group: GroupLike | None) -> None:
    """Average `x` in place over `group` (nothing to do for no group or a group of one)."""
    if group is not None and group.size > 1:
        group.all_reduce(x, op=ReduceOp.AVG)


def broadcast_from_first(x: Array, group: GroupLike | None) -> None:
    """Copy group rank 0's `x` into every rank's `x` (in place)."""
    if group is not None and group.size > 1:
        group.broadcast(x, src=0)


def default_group() -> Any:
    """axond's default process group (set by `axond.init_process_group`), or a clear error."""
    return defaults.require("FSDP/ZeRO (or give mesh=...)")
