"""Parallel wrappers: DDP, the distributed sampler and the device mesh."""

from axond.parallel.ddp import DDP, DDPConfig, DistributedDataParallel, GradientBucket, GradientSynchronizer, GradSyncStrategy
from axond.parallel.mesh import DeviceMesh
from axond.parallel.sampler import DistributedSampler

__all__ = [
    "DDP",
    "DDPConfig",
    "DeviceMesh",
    "DistributedDataParallel",
    "DistributedSampler",
    "GradSyncStrategy",
    "GradientBucket",
    "GradientSynchronizer",
]
