"""Job records: lifecycle state, current generation, submitted-job spec and the event log."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from axond.coordinator.kv import KvSpace
from axond.coordinator.rendezvous import Round

MAX_EVENTS = 100_000
"""Events (output lines, notices) kept per job; a slower reader is told how many it missed."""

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


class EventLog:
    """Append-only job events with a bounded tail; readers hold an absolute index."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.base = 0

    @property
    def end(self) -> int:
        return self.base + len(self.events)

    def append(self, event: Event) -> None:
        self.events.append(event)
        if len(self.events) > MAX_EVENTS:
            drop = len(self.events) - MAX_EVENTS
            del self.events[:drop]
            self.base += drop

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

    @property
    def generation(self) -> int:
        return self.round.generation

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts)

    def active_member(self, node_id: str) -> bool:
        """Whether the node runs part of the current frozen generation and has not exited."""
        return self.round.member(node_id) is not None and node_id not in self.exits
