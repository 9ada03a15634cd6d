"""Where each job's wall time went: productive time against time lost, by cause (plain; the caller holds the lock).

The job's life from its creation (the first join, or `axond run`) to its end is cut into intervals, each charged to
one cause, so the parts add up to the wall time by construction:

- `startup`: the first generation gathering its nodes (once `min_nodes` joined) and settling, until it runs;
- `waiting_for_members`: a rendezvous (first or later) with fewer than `min_nodes` nodes joined;
- `productive`: a generation running;
- `detection`: the end of a running stretch that was lost without anyone knowing yet: from a dead node's last
  heartbeat to the coordinator declaring it dead (a failure a worker reports is detected within its report's
  delay, which the coordinator does not see: that stays productive);
- `reformation`: from a failure (or a node joining a running elastic job) until the next generation runs.

The book observes a job when it changes state (`StateContext.notify`), when it is created or a node joins its
rendezvous, and whenever it is read. It lives in the coordinator's memory: a coordinator that restarts from its
durable state starts the accounts of the jobs it restores again at that moment.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from axond.coordinator.state.jobs import Job, JobState

CAUSES = ("productive", "startup", "waiting_for_members", "detection", "reformation")
"""Every cause wall time is charged to, productive first."""

HISTORY = 240
"""Samples of a job's goodput kept for the dashboard's plot (one per state change, and one per read at most every
`SAMPLE_EVERY_S`)."""

SAMPLE_EVERY_S = 5.0
"""Shortest time between two history samples taken by reads."""


@dataclass
class JobClock:
    """One job's account."""

    job: Job
    created: float
    since: float
    """Start of the open interval (time.monotonic())."""
    cause: str
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    ended: float | None = None
    history: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    """(seconds since creation, wall seconds, productive seconds) samples."""
    created_wall: float = field(default_factory=time.time)

    def totals(self, now: float) -> dict[str, float]:
        """Seconds by cause up to `now` (the open interval included)."""
        out = dict(self.seconds)
        if self.ended is None:
            out[self.cause] += max(0.0, now - self.since)
        return out

    def wall(self, now: float) -> float:
        """Seconds from creation to the end (or `now`), measured apart from the parts."""
        return (self.ended if self.ended is not None else now) - self.created


def _cause(job: Job) -> str | None:
    """The cause the job's time is charged to in its current state (None: it ended)."""
    state = job.state
    if state.terminal:
        return None
    if state is JobState.RUNNING:
        return "productive"
    if not job.round.frozen and len(job.round.joiners) < job.min_nodes:
        return "waiting_for_members"
    return "startup" if job.generation == 1 and state is JobState.PENDING else "reformation"


class GoodputBook:
    """Every job's `JobClock`, by name."""

    def __init__(self) -> None:
        self._clocks: dict[str, JobClock] = {}

    def observe(self, name: str, job: Job | None, now: float | None = None) -> None:
        """Charge the time since the last look to the cause it was in, and switch to the job's current cause."""
        now = time.monotonic() if now is None else now
        clock = self._clocks.get(name)
        if job is None:
            self._clocks.pop(name, None)  # forgotten
            return
        cause = _cause(job)
        if clock is None or clock.job is not job:
            if cause is None:
                return
            self._clocks[name] = JobClock(job, now, now, cause)
            return
        if clock.ended is not None:
            return
        self._charge(clock, now)
        if cause is None:
            clock.ended = now
            self._sample(clock, now)
        elif cause != clock.cause:
            clock.cause = cause
            self._sample(clock, now)

    def _charge(self, clock: JobClock, now: float) -> None:
        clock.seconds[clock.cause] += max(0.0, now - clock.since)
        clock.since = max(clock.since, now)

    def _sample(self, clock: JobClock, now: float) -> None:
        totals = clock.totals(now)
        clock.history.append((now - clock.created, clock.wall(now), totals["productive"]))

    def detected(self, name: str, last_seen: float, now: float) -> None:
        """A node of the running job `name` was declared dead at `now`, silent since `last_seen`: the running time
        since then was lost to detection."""
        clock = self._clocks.get(name)
        if clock is None or clock.ended is not None or clock.cause != "productive":
            return
        start = min(max(last_seen, clock.since), now)
        clock.seconds["productive"] += start - clock.since
        clock.seconds["detection"] += now - start
        clock.since = now

    def read(self, name: str, job: Job | None, now: float | None = None) -> JobClock | None:
        """The job's account, brought up to `now` (a history sample at most every SAMPLE_EVERY_S)."""
        now = time.monotonic() if now is None else now
        self.observe(name, job, now)
        clock = self._clocks.get(name)
        if clock is not None and clock.ended is None:
            if not clock.history or now - clock.created - clock.history[-1][0] >= SAMPLE_EVERY_S:
                self._sample(clock, now)
        return clock
