"""A durable coordinator state reopened as on a restart: the SQLite file closed and opened again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from axond.coordinator.persistence import Persistence, SqlitePersistence


@contextmanager
def sqlite_reopener(path: Path) -> Iterator[Callable[[], Persistence]]:
    """A factory of the SQLite state at `path`: each call closes what it opened before and opens it again; all
    closed on exit."""
    opened: list[SqlitePersistence] = []

    def reopen() -> Persistence:
        for p in opened:
            p.close()
        opened.append(SqlitePersistence(path))
        return opened[-1]

    try:
        yield reopen
    finally:
        for p in opened:
            p.close()
