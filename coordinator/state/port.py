"""The interface between the coordinator's state machine and where its state is kept.

The state machine records what each call changed (`Changes`) and commits it in one transaction
before the call's answer leaves the coordinator; at start it rebuilds itself from `load()`.
Records are JSON-able dicts (see `records.py`), so every implementation stores the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

Record = dict[str, Any]


@dataclass
class JoinerChanges:
    """The joiners of one job's current round that changed, applied after the job's record."""

    generation: int
    reset: bool
    """Every joiner row of the job goes first (a new round, or one whose order changed): `rows` is all of them."""
    rows: dict[str, list[Any] | None]
    """node id -> [hostname, seq, nproc], None: the joiner left; in the round's order (a new one goes last)."""


@dataclass
class Changes:
    """What one call changed; `Persistence.commit` applies it atomically."""

    nodes: dict[str, Record] = field(default_factory=dict)
    """Node records to write, by node id."""
    deleted_nodes: set[str] = field(default_factory=set)
    jobs: dict[str, Record] = field(default_factory=dict)
    """Job records to write, by job name."""
    deleted_jobs: set[str] = field(default_factory=set)
    """Jobs forgotten: their record, store and events go."""
    cleared_stores: set[str] = field(default_factory=set)
    """Jobs whose store was replaced (a new generation): every key and barrier of it goes first."""
    kv: dict[tuple[str, str], tuple[int, bytes | None]] = field(default_factory=dict)
    """(job, key) -> (generation, value); None deletes the key."""
    barriers: dict[tuple[str, str], tuple[int, Record]] = field(default_factory=dict)
    """(job, barrier name) -> (generation, {"world_size", "arrivals"})."""
    events: dict[str, tuple[int, list[Record]]] = field(default_factory=dict)
    """job -> (absolute index of the first event given, the events); older ones are dropped."""
    meta: Record | None = None
    """Counters and the scheduler's queue and deliveries, when they changed."""
    joiners: dict[str, JoinerChanges] = field(default_factory=dict)
    """job -> the joiners of its open round that changed (a job record's round does not hold them)."""
    past_rounds: dict[str, dict[int, Record | None]] = field(default_factory=dict)
    """job -> generation -> a past round's record, written once when it is archived; None: dropped."""

    def __bool__(self) -> bool:
        return bool(self.nodes or self.deleted_nodes or self.jobs or self.deleted_jobs or self.cleared_stores
                    or self.kv or self.barriers or self.events or self.meta is not None or self.joiners
                    or self.past_rounds)


@dataclass
class Snapshot:
    """Everything `load()` found."""

    nodes: list[Record] = field(default_factory=list)
    jobs: list[Record] = field(default_factory=list)
    kv: list[tuple[str, int, str, bytes]] = field(default_factory=list)
    """(job, generation, key, value)."""
    barriers: list[tuple[str, int, str, Record]] = field(default_factory=list)
    events: dict[str, tuple[int, list[Record]]] = field(default_factory=dict)
    """job -> (absolute index of the first kept event, the events in order)."""
    meta: Record | None = None
    joiners: list[tuple[str, int, str, list[Any]]] = field(default_factory=list)
    """(job, generation, node id, [hostname, seq, nproc]) in each round's order."""
    past_rounds: list[tuple[str, int, Record]] = field(default_factory=list)
    """(job, generation, the past round's record)."""


class Persistence(Protocol):
    """Where the coordinator's state lives between restarts."""

    durable: bool
    """Whether commits survive the process (False: kept only in this process)."""

    def load(self) -> Snapshot:
        """Everything committed so far."""

    def commit(self, changes: Changes) -> None:
        """Apply `changes` atomically; when it returns (durable implementations) they survive a crash."""

    def close(self) -> None:
        """Release files and connections."""
