"""What the coordinator's state components share: the job table, the limits, wake-ups and the journal.

Each component (membership, job lifecycle, failures, per-job KV, scheduling, submitted jobs) owns its own part
of the state and gets this one object for the rest: looking up a job, telling waiters a topic
changed, and marking what changed for the durable state's next commit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from axond.coordinator.state.errors import InvalidArgument, NotFound, short
from axond.coordinator.state.goodput import GoodputBook
from axond.coordinator.state.jobs import Job
from axond.coordinator.state.kv_space import ByteBudget, KvSpace
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.state.journal import Journal

Topic = tuple[Hashable, ...]


class StateContext:
    """The job table and the side effects every component needs (plain; the caller holds the lock)."""

    def __init__(self, limits: CoordinatorLimits, listener: Callable[[Topic], None] | None = None) -> None:
        self.limits = limits
        self.budget = ByteBudget(limits.max_store_bytes)
        self.jobs: dict[str, Job] = {}
        self.journal: Journal | None = None
        """Set when the state is durable: what changed since the last commit."""
        self._listener = listener or (lambda topic: None)
        self.goodput = GoodputBook()
        """Where each job's wall time went (the job lifecycle tells it of each change of a job's state)."""

    def listen(self, listener: Callable[[Topic], None]) -> None:
        self._listener = listener

    def notify(self, *topic: Hashable) -> None:
        """Wake the waiters of `topic` (and mark what it names as changed)."""
        if self.journal is not None:
            kind = topic[0]
            if kind in ("job", "events"):
                self.journal.jobs.add(topic[1])  # type: ignore[arg-type]
            elif kind == "key":
                self.journal.kv.add((topic[1], topic[3]))  # type: ignore[arg-type]
            elif kind == "work":
                self.journal.meta = True
        self._listener(topic)

    def job(self, name: str) -> Job:
        """The job called `name`; InvalidArgument or NotFound otherwise."""
        if not name:
            raise InvalidArgument("job must be a non-empty name")
        job = self.jobs.get(name)
        if job is None:
            raise NotFound(f"unknown job {short(name)}: check the name with `axond status`")
        return job

    def new_space(self) -> KvSpace:
        """An empty KV space charged to the coordinator's byte budget."""
        return KvSpace(self.limits, self.budget)

    def mark_job(self, name: str) -> None:
        if self.journal is not None:
            self.journal.jobs.add(name)

    def mark_meta(self) -> None:
        if self.journal is not None:
            self.journal.meta = True

    def mark_kv(self, job: str, key: str) -> None:
        if self.journal is not None:
            self.journal.kv.add((job, key))

    def mark_barrier(self, job: str, name: str) -> None:
        if self.journal is not None:
            self.journal.barriers.add((job, name))

    def store_cleared(self, job: str) -> None:
        if self.journal is not None:
            self.journal.store_cleared(job)

    def job_replaced(self, name: str) -> None:
        if self.journal is not None:
            self.journal.job_replaced(name)
