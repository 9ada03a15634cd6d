"""Durable coordinator state: one interface (`Persistence`), kept in memory, in SQLite, or in etcd (`persistence.etcd`)."""

from axond.coordinator.state.port import Changes, Persistence, Snapshot
from axond.coordinator.persistence.memory import MemoryPersistence
from axond.coordinator.persistence.sqlite import SqlitePersistence

__all__ = ["Changes", "MemoryPersistence", "Persistence", "Snapshot", "SqlitePersistence"]
