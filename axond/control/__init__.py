"""Client side of the control plane: the coordinator client (its KV store is `axond.store.coordinator`)."""

from axond.control.client import CoordinatorClient, connect

__all__ = ["CoordinatorClient", "connect"]
