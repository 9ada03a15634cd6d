"""Parallel wrappers: DDP and the distributed sampler."""

from axond.parallel.ddp import DDP, DDPConfig, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy
from axond.parallel.sampler import DistributedSampler

__all__ = [
    "DDP",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedSampler",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
]
