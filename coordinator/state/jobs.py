"""Job records: lifecycle state, current generation, submitted-job spec and the event log."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from axond.coordinator.state.kv_space import KvSpace
from axond.coordinator.state.rendezvous import Round

MAX_EVENTS = 100_000
"""Events (output lines, notices) kept per job; a slower reader is told how many it missed."""

MAX_LEFT = 64
"""Nodes a job remembers having gone on without (live recovery), so that their late reports are answered."""

CANCELLED_EXIT_CODE = 130
"""Exit code a cancelled job finishes with (the shell's code for an interrupt)."""


class JobState(enum.IntEnum):
    """Same numbers as the proto enum axond.v1.JobState."""

    PENDING = 1
    RUNNING = 2
    RESTARTING = 3
    SUCCEEDED = 4
    FAILED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobSpec:
    """What `axond run` submitted: the command every rank runs and its placement."""

    nnodes: int
    nproc_per_node: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    max_restarts: int
    cwd: str
    min_nodes: int = 0
    """With live recovery: the job goes on while at least this many of its `nnodes` are left (0: `nnodes`)."""
    live_recovery: bool = False
    """`axond run --live-recovery`: a failed node's share is carried by the others (docs/live-recovery.md)."""

    @property
    def least_nodes(self) -> int:
        return self.min_nodes or self.nnodes


@dataclass(frozen=True)
class OutputEvent:
    rank: int
    stream: str
    text: str


@dataclass(frozen=True)
class InfoEvent:
    text: str


@dataclass(frozen=True)
class FinishedEvent:
    exit_code: int
    message: str


Event = OutputEvent | InfoEvent | FinishedEvent


EVENT_OVERHEAD = 64
"""Bytes charged per event on top of its text."""


def _size(event: Event) -> int:
    return EVENT_OVERHEAD + (len(event.text) if isinstance(event, (OutputEvent, InfoEvent)) else len(event.message))


class EventLog:
    """Append-only job events with a bounded tail (count and bytes); readers hold an absolute index."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.events: list[Event] = []
        self.base = 0
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped = 0

    @property
    def end(self) -> int:
        return self.base + len(self.events)

    def append(self, event: Event) -> None:
        self.events.append(event)
        self.bytes += _size(event)
        if len(self.events) > MAX_EVENTS or self.bytes > self.max_bytes:
            drop = 0
            while drop < len(self.events) - 1 and (len(self.events) - drop > MAX_EVENTS or self.bytes > self.max_bytes):
                self.bytes -= _size(self.events[drop])
                drop += 1
            del self.events[:drop]
            self.base += drop
            self.dropped += drop

    def read(self, index: int) -> tuple[list[Event], int, int]:
        """Events from absolute `index`: (events, next index, how many were dropped before them)."""
        skipped = max(0, self.base - index)
        start = max(index, self.base) - self.base
        return self.events[start:], self.end, skipped


@dataclass
class Job:
    """A named job: its rendezvous rounds, restarts, KV space and (if submitted) placement."""

    name: str
    min_nodes: int
    max_nodes: int
    max_restarts: int
    round: Round
    state: JobState = JobState.PENDING
    restarts: int = 0
    reason: str = ""
    kv: KvSpace = field(default_factory=KvSpace)
    exits: dict[str, int] = field(default_factory=dict)
    exit_code: int | None = None
    spec: JobSpec | None = None
    assigned: list[str] = field(default_factory=list)
    events: EventLog = field(default_factory=EventLog)
    placement_note: str = ""
    past_rounds: list[Round] = field(default_factory=list)
    finished_at: float | None = None
    """When the job reached a terminal state (the coordinator's monotonic clock)."""
    live: bool = False
    """Live recovery (`axond worker --live-recovery`): a failed node's generation is replaced by one of the
    survivors, whose ranks keep running, while at least `min_nodes` are left."""
    live_generation: int = 0
    """The last generation opened by live recovery (0: none)."""
    left: list[str] = field(default_factory=list)
    """The nodes live recovery went on without, latest last (bounded: `MAX_LEFT`)."""

    @property
    def generation(self) -> int:
        return self.round.generation

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts)

    def active_member(self, node_id: str) -> bool:
        """Whether the node runs part of the current frozen generation and has not exited."""
        return self.round.member(node_id) is not None and node_id not in self.exits
