"""FullyShardedDataParallel: parameters, gradients and optimizer state sharded over the ranks (ZeRO-2/3)."""

from axond.parallel.fsdp.config import CPUOffload, FSDPConfig, ShardingStrategy
from axond.parallel.fsdp.flat_param import FlatLayout, shard_numel
from axond.parallel.fsdp.fsdp import FSDP, FullyShardedDataParallel
from axond.parallel.fsdp.unit import FSDPUnit
from axond.parallel.fsdp.wrap import FlattenedParameter

__all__ = [
    "CPUOffload",
    "FSDP",
    "FSDPConfig",
    "FSDPUnit",
    "FlatLayout",
    "FlattenedParameter",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "shard_numel",
]
