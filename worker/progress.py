"""What a waiting worker tells its user: rendezvous progress, and local ranks that exited while others run.

Both exist because a worker that waits says nothing otherwise: a missing node or a rank that returned
before `init_process_group` leaves the others waiting for their full timeout in silence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.launcher import RankExit

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

PROGRESS_EVERY_S = 5.0
"""Seconds between two rendezvous progress lines (and before the first)."""

EARLY_EXIT_NOTICE_S = 5.0
"""Seconds a local rank may have exited 0 while others still run before the worker says so (once)."""

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
    return f"job {job!r}: {joined}/{wanted} nodes joined{hosts}; {waiting}, up to {max(left_s, 0):.0f} s"


class JoinProgress:
    """While `join` long-polls, ask the coordinator for the job's status every `every` seconds and
    pass a progress line to `notice`. Use as a context manager around the join."""

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
        while not self._stop.wait(self._every):
            try:
                jobs = self._client.get_status(self._job).jobs
            except (CoordinatorError, ValueError):
                continue  # the join call reports a lost coordinator; progress is only a courtesy
            status = next((j for j in jobs if j.job == self._job), None)
            if status is not None and status.state not in _OPEN_STATES:
                continue
            if not self._stop.is_set():
                self._notice(progress_line(self._job, status, *self._bounds, self._deadline - time.monotonic()))


class EarlyExitWatch:
    """Says once per generation when local ranks exited 0 a while ago but others still run: if those
    wait for them (in `init_process_group` or a collective), they will wait until their timeout."""

    def __init__(self, job: str, notice: Callable[[str], None], after: float = EARLY_EXIT_NOTICE_S) -> None:
        self._job, self._notice, self._after = job, notice, after
        self._first_seen: float | None = None
        self._told = False

    def check(self, exits: Sequence[RankExit], all_ranks: Sequence[int]) -> None:
        """Call on each monitor tick with the exits so far and every local rank's global rank."""
        if self._told or not exits or len(exits) == len(all_ranks):
            return
        now = time.monotonic()
        if self._first_seen is None:
            self._first_seen = now
        if now - self._first_seen < self._after:
            return
        self._told = True
        gone = ", ".join(str(e.rank) for e in sorted(exits, key=lambda e: e.rank))
        done = {e.rank for e in exits}
        running = ", ".join(str(r) for r in all_ranks if r not in done)
        self._notice(
            f"job {self._job!r}: rank(s) {gone} exited with code 0 but rank(s) {running} still run; if those "
            "wait for them (init_process_group, a collective), they fail at their timeout"
        )
