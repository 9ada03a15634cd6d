"""DistributedDataParallel: gradient buckets reduced during backward."""

from axond.parallel.ddp.buckets import GradientBucket, GradientSynchronizer
from axond.parallel.ddp.config import DDPConfig, GradSyncStrategy
from axond.parallel.ddp.ddp import DDP, DistributedDataParallel

__all__ = ["DDP", "DDPConfig", "DistributedDataParallel", "GradSyncStrategy", "GradientBucket", "GradientSynchronizer"]
