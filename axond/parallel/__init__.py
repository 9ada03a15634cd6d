"""Parallel wrappers: DDP, FSDP, ZeRO-1, pipeline and tensor parallelism, the parameter server, the distributed
sampler and the device mesh."""

from axond.parallel.ddp import DDP, DDPConfig, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy
from axond.parallel.fsdp import FSDP, CPUOffload, FSDPConfig, FullyShardedDataParallel, ShardingStrategy
from axond.parallel.memory import memory_estimate, memory_savings
from axond.parallel.mesh import DeviceMesh
from axond.parallel.mixed_precision import MixedPrecision
from axond.parallel.pipeline import Pipeline, PipelineSchedule
from axond.parallel.ps import ParameterServer, PSMode
from axond.parallel.sampler import DistributedSampler
from axond.parallel.tensor import (
    ColumnParallelLinear, CopyToParallelRegion, GatherFromParallelRegion, ParallelCausalSelfAttention, ParallelMLP,
    ParallelTransformerBlock, ReduceFromParallelRegion, RowParallelLinear, ScatterToParallelRegion,
)
from axond.parallel.zero import ZeroRedundancyOptimizer

__all__ = [
    "CPUOffload",
    "ColumnParallelLinear",
    "CopyToParallelRegion",
    "DDP",
    "DDPConfig",
    "DeviceMesh",
    "DistributedDataParallel",
    "DistributedSampler",
    "FSDP",
    "FSDPConfig",
    "FullyShardedDataParallel",
    "GradSyncStrategy",
    "GradientBucket",
    "GatherFromParallelRegion",
    "MixedPrecision",
    "GradientSynchronizer",
    "ParallelCausalSelfAttention",
    "ParallelMLP",
    "ParallelTransformerBlock",
    "ParameterServer",
    "PSMode",
    "Pipeline",
    "PipelineSchedule",
    "ReduceFromParallelRegion",
    "RowParallelLinear",
    "ScatterToParallelRegion",
    "ShardingStrategy",
    "ZeroRedundancyOptimizer",
    "memory_estimate",
    "memory_savings",
]
