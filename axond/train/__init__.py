"""Training loops on top of the parallel wrappers: `DistributedTrainer` with checkpoints and exact resume."""

from axond.errors import ReplicaDivergence
from axond.train.digest import check_replicas, replica_digest
from axond.train.guard import CheckpointGuardError
from axond.train.stragglers import StragglerCallback, find_stragglers
from axond.train.trainer import Callback, DistributedTrainer

__all__ = ["Callback", "CheckpointGuardError", "DistributedTrainer", "ReplicaDivergence", "StragglerCallback",
           "check_replicas", "find_stragglers", "replica_digest"]
