"""State kept in this process only (`--in-memory`): the same records, nothing survives a restart."""

from __future__ import annotations

from axond.coordinator.state.port import Changes, Record, Snapshot
from axond.coordinator.persistence.tables import Tables


class MemoryPersistence:
    """The `Persistence` contract over dicts; what `load` returns is what was committed."""

    durable = False

    def __init__(self) -> None:
        self._tables = Tables()

    def load(self) -> Snapshot:
        return self._tables.snapshot()

    def commit(self, changes: Changes) -> None:
        self._tables.apply(changes)

    def close(self) -> None:
        self._tables = Tables()


__all__ = ["MemoryPersistence", "Record"]
