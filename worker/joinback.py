"""Joining back on the worker's side: say which path a node took into a running live job, and let a node whose rank
failed re-join the job it left as a replacement while restarts are left.

A worker whose ranks start in a generation that live recovery opened (`beat.live` for the generation it joined)
joined a running job: its ranks take their state from a live peer (`axond.train.join`) and the others keep theirs.
A fresh node counts no restart; a node that live recovery went on without and that re-joins (its worker restarted
its ranks) counts one against `--max-restarts`, and is refused once none is left (the job goes on without it).
A node cut off from the coordinator for longer than its lease (its link down, its worker frozen) stopped its ranks
and was declared dead; once it reaches the coordinator again it reports that failure (`report_when_back`) and, while
restarts are left, re-joins the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb

RETRY_S = 0.5
"""How often a node that lost its lease asks the coordinator again while it cannot reach it."""


class JoinNotice:
    """One notice, once the first heartbeat of generation `generation` says whether it was opened live."""

    def __init__(self, job: str, generation: int, restarts_left: int, rejoined: bool,
                 notice: Callable[[str], None]) -> None:
        self.job, self.generation, self.restarts_left, self.rejoined = job, generation, restarts_left, rejoined
        self.notice = notice
        self.done = False

    def check(self, beat: pb.HeartbeatResponse | None) -> None:
        if self.done or beat is None or beat.generation < self.generation:
            return
        self.done = True
        if beat.generation != self.generation or not beat.live:
            return
        counted = ("re-joined after its rank failed: one restart counted" if self.rejoined
                   else "a new node: no restart counted")
        self.notice(f"job {self.job!r} generation {self.generation}: this node joined the running job live ({counted}, "
                    f"restarts left {self.restarts_left}); its ranks take the state from a live peer, the running "
                    "ranks keep their processes")


def rejoin_after_left(job: str, message: str, restarts_left: int, notice: Callable[[str], None]) -> bool:
    """After live recovery went on without this node (its rank failed): whether its worker joins the job again as a
    replacement (restarts left), saying which path it takes either way."""
    if restarts_left <= 0:
        notice(f"{message}; job {job!r} goes on without this node (live recovery; no restarts left to re-join it)")
        return False
    notice(f"{message}; job {job!r} goes on without this node (live recovery); re-joining it as a replacement, "
           f"which counts one restart (restarts left {restarts_left})")
    return True


def report_when_back(report: Callable[[], pb.ReportFailureResponse], wait_s: float,
                     stopped: Callable[[], bool]) -> pb.ReportFailureResponse | None:
    """After this node lost its lease and stopped its ranks: `report()` their failure once the coordinator answers
    again (asked every RETRY_S for at most `wait_s`); None if it did not answer by then, or the worker was stopped.
    The coordinator answers `left_job` when the live job went on without this node (it declared it dead, or does so
    now), `will_restart` when the job restarts everyone."""
    deadline = time.monotonic() + wait_s
    while not stopped():
        try:
            return report()
        except CoordinatorError as e:
            code = getattr(e.__cause__, "code", None)
            unreachable = callable(code) and code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not unreachable or time.monotonic() + RETRY_S > deadline:
                return None
            time.sleep(RETRY_S)
    return None
