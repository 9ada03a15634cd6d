"""Key-value stores: where the ranks of a job meet (addresses, IDs, barriers). Which to use: docs/collectives.md.

`axond.store.coordinator.CoordinatorStore` (the coordinator's, reached through `axond.control`) is not imported
here: it brings gRPC, which `import axond` does not load.
"""

from axond.store.base import MAX_KEY_CHARS, MAX_VALUE_BYTES, PrefixStore, Store
from axond.store.file import FileStore
from axond.store.memory import InMemoryStore
from axond.store.over_torch import AxondStoreOverTorch
from axond.store.tcp import TCPStore
from axond.store.torch_agent import TorchAgentStore

__all__ = ["MAX_KEY_CHARS", "MAX_VALUE_BYTES", "AxondStoreOverTorch", "FileStore", "InMemoryStore", "PrefixStore",
           "Store", "TCPStore", "TorchAgentStore"]
