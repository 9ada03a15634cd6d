"""What a waiting worker tells its user: rendezvous progress, and local ranks that exited while others run.

Both exist because a worker that waits says nothing otherwise: a missing node or a rank that returned
before `init_process_group` leaves the others waiting for their full timeout in silence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from axond.config import WAIT_NOTICE_S as DEFAULT_WAIT_NOTICE_S
from axond.distributed.diagnostics.inflight import Blocked, blocked_text
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.launcher import RankExit

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

PROGRESS_EVERY_S = 5.0
"""Seconds between two rendezvous progress lines (and before the first)."""

PROGRESS_REPEAT_S = 60.0
"""Seconds after which an unchanged progress line is said again (with the time left)."""

EARLY_EXIT_NOTICE_S = 5.0
"""Seconds a local rank may have exited 0 while others still run before the worker says so."""

WAIT_NOTICE_S = DEFAULT_WAIT_NOTICE_S
"""Seconds between two "still waiting" notices while ranks wait (AXOND_WAIT_NOTICE_S overrides it)."""

MIN_POLL_S = 0.05
"""Shortest wait between two reads of the ranks' reports (for very short AXOND_WAIT_NOTICE_S in tests)."""

_OPEN_STATES = (pb.JOB_STATE_PENDING, pb.JOB_STATE_RESTARTING)
"""Job states in which a rendezvous may be open."""


def progress_line(job: str, status: pb.JobStatus | None, min_nodes: int, max_nodes: int, left_s: float) -> str:
    """`job 'J': 1/2 nodes joined (host-a); waiting for 1 more, up to 295 s` from the job's status."""
    joined = 0
    hosts = ""
    if status is not None:
        joined = len(status.joined_hosts) or status.nnodes
        if status.joined_hosts:
            hosts = f" ({', '.join(status.joined_hosts)})"
    lo = status.min_nodes if status is not None and status.min_nodes else min_nodes
    hi = status.max_nodes if status is not None and status.max_nodes else max_nodes
    wanted = f"{hi}" if lo == hi else f"{lo}..{hi}"
    more = max(lo - joined, 0)
    waiting = f"waiting for {more} more" if more else "waiting for late joiners"
    note = f" [{status.reason}]" if status is not None and status.reason else ""
    return f"job {job!r}: {joined}/{wanted} nodes joined{hosts}; {waiting}{note}, up to {max(left_s, 0):.0f} s"


class JoinProgress:
    """While `join` long-polls, ask the coordinator for the job's status every `every` seconds and pass a
    progress line to `notice` when it changed (who joined, how many are missing), or when it has said the same
    for `PROGRESS_REPEAT_S`. Use as a context manager around the join."""

    def __init__(
        self, client: CoordinatorClient, job: str, min_nodes: int, max_nodes: int, timeout: float,
        notice: Callable[[str], None], every: float = PROGRESS_EVERY_S,
    ) -> None:
        self._client, self._job, self._notice, self._every = client, job, notice, every
        self._bounds = (min_nodes, max_nodes)
        self._deadline = time.monotonic() + timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"axond-join-progress-{job}", daemon=True)

    def __enter__(self) -> JoinProgress:
        if self._every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._client.call_timeout + 1.0)

    def _main(self) -> None:
        last, said = "", 0.0
        while not self._stop.wait(self._every):
            try:
                jobs = self._client.get_status(self._job).jobs
            except (CoordinatorError, ValueError):
                continue  # the join call reports a lost coordinator; progress is only a courtesy
            status = next((j for j in jobs if j.job == self._job), None)
            if status is not None and status.state not in _OPEN_STATES:
                continue
            line = progress_line(self._job, status, *self._bounds, self._deadline - time.monotonic())
            same = line.rsplit(", up to ", 1)[0]
            now = time.monotonic()
            if same == last and now - said < PROGRESS_REPEAT_S:
                continue  # nothing changed: say it again only after a while
            if not self._stop.is_set():
                last, said = same, now
                self._notice(line)




def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s"


class EarlyExitWatch:
    """Tells the user, while a generation runs, when ranks wait for others:

    - local ranks exited 0 while others still run: said once after `after` seconds (if those wait for them, in
      `init_process_group` or a collective, they fail at their timeout), then every `every` seconds with how long
      ago they exited, how long the others have run, and what those report being blocked in;
    - every rank still runs but one reports being blocked in a collective for `every` seconds or more: said every
      `every` seconds, naming the op, its group and for how long, and the ranks that report no op (outside axond:
      computing, or stuck in their own code).

    `blocked` reads what each given global rank reports being blocked in (`axond.distributed.diagnostics.inflight`);
    it is called every `every / 4` seconds while no rank reports a blocked op (one store read per local rank: light on
    the coordinator), and once a report says since when an op waits, next when that op will have waited `every`
    seconds, so that the notice comes at the documented time, not up to an interval late. It may return None when
    it cannot tell.
    """

    def __init__(self, job: str, notice: Callable[[str], None], after: float = EARLY_EXIT_NOTICE_S,
                 every: float | None = None,
                 blocked: Callable[[Sequence[int]], dict[int, Blocked] | None] | None = None,
                 clock: Callable[[], float] = time.time, stacks: Callable[[int], str] | None = None,
                 fr_dump_dir: str | None = None) -> None:
        """`clock`: the wall clock the reports' times are on (tests pass their own). `stacks`: a local rank's Python
        stacks, or why there are none (`axond.worker.stacks`), told once per hang for each rank that reports no
        blocked op while others wait for it. `fr_dump_dir`: the ranks' AXOND_FR_DUMP_DIR, where each blocked rank
        writes its Flight Recorder dump by itself; the notice says so, and how to read them."""
        self._job, self._notice, self._clock, self._stacks = job, notice, clock, stacks
        self._fr_dump_dir = fr_dump_dir
        self._dumped: set[int] = set()
        self._every = WAIT_NOTICE_S if every is None else every
        self._after = min(after, self._every) if self._every > 0 else after
        self._blocked = blocked
        self._started = clock()
        self._first_seen: float | None = None
        self._told = False
        self._last_notice = 0.0
        self._next_poll = self._started + self._poll_every()

    def _poll_every(self) -> float:
        return max(self._every / 4, MIN_POLL_S)

    def check(self, exits: Sequence[RankExit], all_ranks: Sequence[int]) -> None:
        """Call on each monitor tick with the exits so far and every local rank's global rank."""
        now = self._clock()
        if len(exits) == len(all_ranks):
            return
        if exits:
            self._check_early(exits, all_ranks, now)
        elif self._every > 0 and self._blocked is not None and now >= self._next_poll:
            self._check_blocked(all_ranks, now)

    def _reports(self, ranks: Sequence[int]) -> dict[int, Blocked]:
        if self._blocked is None:
            return {}
        try:
            return self._blocked(ranks) or {}
        except Exception:  # noqa: BLE001 - the notice is a courtesy; the store may be gone
            return {}

    def _check_early(self, exits: Sequence[RankExit], all_ranks: Sequence[int], now: float) -> None:
        if self._first_seen is None:
            self._first_seen = now
        if not self._told:
            if now - self._first_seen < self._after:
                return
            self._told, self._last_notice = True, now
            done = {e.rank for e in exits}
            self._notice(
                f"job {self._job!r}: rank(s) {_ranks(done)} exited with code 0 but rank(s) "
                f"{_ranks([r for r in all_ranks if r not in done])} still run; if those wait for them "
                "(init_process_group, a collective), they fail at their timeout"
            )
            return
        if self._every <= 0 or now - self._last_notice < self._every:
            return
        self._last_notice = now
        done = {e.rank for e in exits}
        running = [r for r in all_ranks if r not in done]
        reports = self._reports(running)
        what = "; ".join(f"rank {r} blocked in {blocked_text(ops)}" for r, ops in sorted(reports.items()) if ops)
        self._notice(
            f"job {self._job!r}: still waiting: rank(s) {_ranks(done)} exited with code 0 "
            f"{_ago(now - self._first_seen)} ago; rank(s) {_ranks(running)} still run, for "
            f"{_ago(now - self._started)}" + (f" ({what})" if what else "")
        )

    def _check_blocked(self, all_ranks: Sequence[int], now: float) -> None:
        self._next_poll = now + self._poll_every()
        if now - self._last_notice < self._every:
            self._next_poll = max(self._next_poll, self._last_notice + self._every)
            return
        reports = self._reports(all_ranks)
        longest = max((now - since for ops in reports.values() for _, _, since in ops), default=None)
        if longest is None:
            self._dumped.clear()  # nobody waits: the next hang is a new one
            return
        if longest < self._every:
            self._next_poll = now + max(self._every - longest, MIN_POLL_S)  # when that op has waited `every`
            return
        self._last_notice = now
        self._next_poll = now + self._every
        parts = [f"rank {r} blocked in {blocked_text(reports[r], now)}" for r in sorted(reports) if reports[r]]
        outside = [r for r in all_ranks if not reports.get(r)]
        if outside:
            parts.append(f"rank(s) {_ranks(outside)} report no blocked op (outside axond: computing, or stuck in "
                         "their own code)")
        if self._fr_dump_dir:
            where = self._fr_dump_dir
            parts.append(f"the blocked ranks write their Flight Recorder dumps to {where} (read them with `python -m "
                         f"torch.distributed.flight_recorder.fr_trace --allow-incomplete-ranks {where}`)")
        self._notice(f"job {self._job!r}: still waiting: " + "; ".join(parts))
        if self._stacks is not None:
            for r in outside:
                if r not in self._dumped:
                    self._dumped.add(r)
                    self._notice(f"job {self._job!r}: rank {r}, which the others wait for: {self._stacks(r)}")
