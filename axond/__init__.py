"""axond: a distributed-training runtime (coordinator, workers, collectives, parallel wrappers)."""

from axond.errors import AxondError, BackendUnavailable, CoordinatorError, DistributedError, StoreError, StoreTimeout

__version__ = "0.1.0"
