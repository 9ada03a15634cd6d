"""DistributedDataParallel: gradient buckets reduced during backward, optionally through a communication hook."""

from axond.parallel.ddp import hooks
from axond.parallel.ddp.buckets import GradientBucket, GradientSynchronizer
from axond.parallel.ddp.config import DDPConfig, GradSyncStrategy
from axond.parallel.ddp.ddp import DDP, DistributedDataParallel
from axond.parallel.ddp.hooks import GradBucket, HookFuture, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from axond.parallel.ddp.powersgd import PowerSGDState, powerSGD_hook

__all__ = ["DDP", "DDPConfig", "DistributedDataParallel", "GradBucket", "GradSyncStrategy", "GradientBucket",
           "GradientSynchronizer", "HookFuture", "PowerSGDState", "allreduce_hook", "bf16_compress_hook",
           "fp16_compress_hook", "hooks", "powerSGD_hook"]
