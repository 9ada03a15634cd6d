"""Key-value stores: where the ranks of a job meet (addresses, IDs, barriers). See docs/stores.md."""

from axond.store.base import MAX_VALUE_BYTES, PrefixStore, Store
from axond.store.file import FileStore
from axond.store.memory import InMemoryStore
from axond.store.tcp import TCPStore
from axond.store.torch_agent import TorchAgentStore

__all__ = ["MAX_VALUE_BYTES", "FileStore", "InMemoryStore", "PrefixStore", "Store", "TCPStore", "TorchAgentStore"]
