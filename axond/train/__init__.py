"""Training loops on top of the parallel wrappers: `DistributedTrainer` with checkpoints and exact resume."""

from axond.train.guard import CheckpointGuardError
from axond.train.trainer import Callback, DistributedTrainer

__all__ = ["Callback", "CheckpointGuardError", "DistributedTrainer"]
