"""Client side of the control plane: the coordinator client and its KV store."""

from axond.control.client import CoordinatorClient, connect
from axond.control.coordinator_store import CoordinatorStore

__all__ = ["CoordinatorClient", "CoordinatorStore", "connect"]
