"""Where each job's wall time went: productive time against time lost, by cause (plain; the caller holds the lock).

The job's life from its creation (the first join, or `axond run`) to its end is cut into intervals, each charged to
one cause, so the parts add up to the wall time by construction:

- `startup`: the first generation gathering its nodes (once `min_nodes` joined) and settling, and its ranks starting
  (importing, building their groups) until they run their collectives;
- `waiting_for_members`: a rendezvous (first or later) with fewer than `min_nodes` nodes joined;
- `productive`: a generation running, once its ranks run their collectives (every rank has published its first
  arrival marks, `axond.distributed.diagnostics.arrivals`: its first collectives are done) and while none is hung;
- `hung`: a running generation one of whose ranks reports being blocked in a collective (its in-flight report,
  `axond.distributed.diagnostics.inflight`, published after a quarter of the group timeout), from the moment it
  entered that op until no rank reports one;
- `detection`: the end of a running stretch that was lost without anyone knowing yet: from a dead node's last
  heartbeat to the coordinator declaring it dead (a failure a worker reports is detected within its report's
  delay, which the coordinator does not see: that stays productive);
- `reformation`: from a failure (or a node joining a running elastic job) until the next generation's ranks run
  their collectives again (their start-up after a restart is lost time, not productive).

What the ranks publish is read when the book is read (`axond status`, /metrics, the dashboard: `read`), through the
`probe`; the ranks' start is placed at the last of their first marks (each rank publishes its time), a hang at the
moment its rank entered the op. A job that no one reads while it runs stays in start-up until it ends. Jobs over
`MAX_PROBED_RANKS` ranks, and a book without a probe, count a running generation as productive from its start.

The book observes a job when it changes state (`StateContext.notify`), when it is created or a node joins its
rendezvous, and whenever it is read. It lives in the coordinator's memory: a coordinator that restarts from its
durable state starts the accounts of the jobs it restores again at that moment.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from axond.coordinator.state.jobs import Job, JobState
from axond.distributed.diagnostics.arrivals import KEY as ARRIVALS_KEY
from axond.distributed.diagnostics.inflight import KEY as INFLIGHT_KEY

CAUSES = ("productive", "startup", "waiting_for_members", "detection", "reformation", "hung")
"""Every cause wall time is charged to, productive first."""

HISTORY = 240
"""Samples of a job's goodput kept for the dashboard's plot (one per state change, and one per read at most every
`SAMPLE_EVERY_S`)."""

SAMPLE_EVERY_S = 5.0
"""Shortest time between two history samples taken by reads."""

MAX_PROBED_RANKS = 256
"""The most ranks of a job whose reports a read looks at (two store reads each)."""

Probe = Callable[[Job], tuple[bool, "float | None", "float | None"]]
"""job -> (every rank of its running generation started its collectives, the wall time the last of them did (None:
not published), the earliest wall time a rank reports being blocked in a collective since (None: none is))."""


def probe_ranks(job: Job) -> tuple[bool, float | None, float | None]:
    """`Probe` from what the ranks published in the job generation's store: their arrival marks (with the time of
    their first mark) and their in-flight reports."""
    world = job.round.world_size
    if world > MAX_PROBED_RANKS:
        return True, None, None
    started, last, since = True, 0.0, None
    for rank in range(world):
        first = _started_at(job.kv.get(ARRIVALS_KEY.format(rank)))
        started = started and first is not None
        if started and first is not None:
            last = max(last, first)
        for t in _blocked_since(job.kv.get(INFLIGHT_KEY.format(rank))):
            since = t if since is None else min(since, t)
    return started, (last or None) if started else None, since


def _started_at(raw: bytes | None) -> float | None:
    """The wall time of a rank's first mark from its arrivals (0.0: published without one; None: none published)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw).get("started", 0.0)
        return float(value) if isinstance(value, (int, float)) else 0.0
    except (ValueError, AttributeError):
        return 0.0


def _blocked_since(raw: bytes | None) -> list[float]:
    if raw is None:
        return []
    try:
        return [float(o["since"]) for o in json.loads(raw).get("ops", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


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
    started: int = 0
    """The last generation whose ranks were seen running their collectives."""
    hung_since: float | None = None
    """time.monotonic() since when a rank of the running generation is hung (None: none)."""

    def totals(self, now: float) -> dict[str, float]:
        """Seconds by cause up to `now` (the open interval included)."""
        out = dict(self.seconds)
        if self.ended is None:
            out[self.cause] += max(0.0, now - self.since)
        return out

    def wall(self, now: float) -> float:
        """Seconds from creation to the end (or `now`), measured apart from the parts."""
        return (self.ended if self.ended is not None else now) - self.created


def _cause(job: Job, clock: JobClock | None = None) -> str | None:
    """The cause the job's time is charged to in its current state (None: it ended)."""
    state = job.state
    if state.terminal:
        return None
    if state is JobState.RUNNING:
        if clock is None or clock.started >= job.generation:
            return "hung" if clock is not None and clock.hung_since is not None else "productive"
        return "startup" if job.generation == 1 else "reformation"
    if not job.round.frozen and len(job.round.joiners) < job.min_nodes:
        return "waiting_for_members"
    return "startup" if job.generation == 1 and state is JobState.PENDING else "reformation"


class GoodputBook:
    """Every job's `JobClock`, by name."""

    def __init__(self) -> None:
        self._clocks: dict[str, JobClock] = {}
        self.probe: Probe | None = probe_ranks
        """What the ranks of a running generation published (`probe_ranks`); None: running is productive."""

    def observe(self, name: str, job: Job | None, now: float | None = None) -> None:
        """Charge the time since the last look to the cause it was in, and switch to the job's current cause."""
        now = time.monotonic() if now is None else now
        clock = self._clocks.get(name)
        if job is None:
            self._clocks.pop(name, None)  # forgotten
            return
        if clock is None or clock.job is not job:
            cause = _cause(job, None if self.probe is None else JobClock(job, now, now, ""))
            if cause is None:
                return
            self._clocks[name] = JobClock(job, now, now, cause)
            return
        cause = _cause(job, clock if self.probe is not None else None)
        if clock.ended is not None:
            return
        if job.state is not JobState.RUNNING:
            clock.hung_since = None  # a hang of the generation that ended: the next one is looked at afresh
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

    def _look(self, name: str, job: Job, now: float) -> None:
        """Ask the probe about the ranks of the job's running generation; a hang found starts where its op did."""
        clock = self._clocks.get(name)
        if self.probe is None or clock is None or clock.job is not job or job.state is not JobState.RUNNING:
            return
        started, started_wall, since = self.probe(job)
        if started and clock.started < job.generation:
            clock.started = job.generation
            if started_wall is not None and clock.cause in ("startup", "reformation"):
                begun = now - max(0.0, time.time() - started_wall)
                if begun > clock.since:  # running from the last rank's first mark, not from this read
                    self._charge(clock, min(begun, now))
                    clock.cause = "productive"
        if since is None:
            clock.hung_since = None
        elif clock.hung_since is None:
            clock.hung_since = now - max(0.0, time.time() - since)
            if clock.cause == "productive" and clock.hung_since > clock.since:
                self._charge(clock, clock.hung_since)  # productive until the op began; hung from there
                clock.cause = "hung"

    def read(self, name: str, job: Job | None, now: float | None = None) -> JobClock | None:
        """The job's account, brought up to `now` (a history sample at most every SAMPLE_EVERY_S)."""
        now = time.monotonic() if now is None else now
        if job is not None:
            self._look(name, job, now)
        self.observe(name, job, now)
        clock = self._clocks.get(name)
        if clock is not None and clock.ended is None:
            if not clock.history or now - clock.created - clock.history[-1][0] >= SAMPLE_EVERY_S:
                self._sample(clock, now)
        return clock
