"""A runner's word to the coordinator about its generation: its exit, the wait for the job's end after it (the exit
barrier), the wait for another node's report when a local failure was that node's consequence, a link it cannot
reach while every node keeps its lease, each call sent again while the coordinator is briefly unreachable (within
the node's lease); and the stacks of local ranks that failed ranks were waiting for (`tell_accused`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import grpc

from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.causes import Elsewhere
from axond.worker.heartbeat import Heartbeater
from axond.fencing import FENCE_TERM_S
from axond.worker.blame import blamed
from axond.worker.joinback import rejoin_after_left
from axond.worker.launcher import CAUSE_GRACE_S, LocalRanks
from axond.worker.linkcheck import LinkCheck
from axond.worker.outcome import JOB_FAILED_ELSEWHERE_EXIT_CODE, TERMINAL_STATES, JobOutcome, Notice
from axond.worker.spec import JobSpec

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

R = TypeVar("R")
MONITOR_TICK_S = 0.05
"""How often a runner's loops look again when nothing woke them."""


class Reports:
    """One runner's reports to the coordinator (its client, node, job, heartbeats, stop event and notices)."""

    def __init__(self, client: CoordinatorClient, node_id: str, spec: JobSpec, hb: Heartbeater,
                 stop: threading.Event, notice: Notice) -> None:
        self._client, self._node_id, self._spec, self._hb = client, node_id, spec, hb
        self._stop, self._notice = stop, notice

    def told_of_other_failure(self, gen: int) -> Elsewhere | None:
        """After a local rank failed because of a rank on another node: wait (up to CAUSE_GRACE_S) for that node's
        report to move the job on, so that the job's reason is the root cause, not this node's consequence of it.
        None if nobody did (then this node reports its own failure)."""
        deadline = time.monotonic() + CAUSE_GRACE_S
        while time.monotonic() < deadline and not self._stop.is_set():
            self._hb.beat_now()
            beat = self._hb.latest(self._spec.job)
            if beat is not None and beat.job_state in TERMINAL_STATES:
                return Elsewhere(JobOutcome(JOB_FAILED_ELSEWHERE_EXIT_CODE, beat.reason or "the job failed elsewhere"))
            if beat is not None and beat.generation > gen:
                self._notice(f"job {self._spec.job!r} moved to generation {beat.generation} ({beat.reason}); "
                             "re-joining")
                return Elsewhere(None)
            time.sleep(0.1)
        return None

    def exit_barrier(self, gen: int) -> JobOutcome | None:
        """After local success, stay until the whole job ended: if another node fails first, the
        job restarts and needs this node again (returns None to re-join), or fails, and so does this
        node's outcome. Bounded by join_timeout."""
        spec = self._spec
        deadline = time.monotonic() + spec.join_timeout
        self._hb.beat_now()
        while time.monotonic() < deadline and not self._stop.is_set():
            beat = self._hb.latest(spec.job)
            if beat is not None and beat.job_state in TERMINAL_STATES:
                if beat.job_state != pb.JOB_STATE_SUCCEEDED:
                    self._notice(f"this node's ranks exited 0, but job {spec.job!r} ended: {beat.reason}")
                    return JobOutcome(JOB_FAILED_ELSEWHERE_EXIT_CODE, beat.reason or "the job failed on another node")
                break
            if beat is not None and beat.generation > gen and spec.live_recovery and beat.live:
                gen = beat.generation  # re-formed live without this node, whose ranks are done: it waits for the end
                continue
            if beat is not None and beat.generation > gen:
                self._notice(f"job {spec.job!r} moved to generation {beat.generation} ({beat.reason}); re-joining")
                return None
            self._hb.changed.wait(MONITOR_TICK_S)
            self._hb.changed.clear()
        return JobOutcome(0)

    def within_lease(self, call: Callable[[], R]) -> R:
        """`call()`, sent again while the coordinator is unreachable, for at most one lease or the outage grace
        (a restart of the coordinator within that time disturbs nothing)."""
        deadline = time.monotonic() + max(self._hb.lease, self._spec.outage_grace)
        while True:
            try:
                return call()
            except CoordinatorError as e:
                code = getattr(e.__cause__, "code", None)
                unreachable = callable(code) and code() in (grpc.StatusCode.UNAVAILABLE,
                                                             grpc.StatusCode.DEADLINE_EXCEEDED)
                if not unreachable or time.monotonic() + 0.5 > deadline or self._stop.is_set():
                    raise
                time.sleep(0.5)

    def report_exit(self, gen: int, exit_code: int) -> None:
        try:
            self.within_lease(lambda: self._client.report_exit(self._spec.job, self._node_id, gen, exit_code))
        except (CoordinatorError, ValueError) as e:
            self._notice(f"could not report the exit of job {self._spec.job!r} to the coordinator: {e}")

    def report_cut(self, ranks: LocalRanks, gen: int, lost: list[int], links: LinkCheck, restarts_left: int,
                   flush: Callable[[], None]) -> tuple[bool, JobOutcome | None]:
        """This node's ranks run but cannot reach node ranks `lost`: tell the coordinator, which decides which node the
        job goes on without. Returns (ended, outcome): ended when it is this node (its ranks stopped; outcome None to
        re-join as a replacement with restarts left: the caller re-joins)."""
        spec = self._spec
        where = ", ".join(f"node rank {r} ({links.address(r)})" for r in lost)
        cause = links.cause.strip() or "a collective failed"
        self._notice(f"job {spec.job!r}: this node cannot reach {where} on the data plane, while every node keeps its "
                     f"lease (a cut link; {cause}); telling the coordinator, the ranks keep running")
        try:
            reply = self.within_lease(lambda: self._client.report_failure(
                spec.job, self._node_id, gen, -1, JOB_FAILED_ELSEWHERE_EXIT_CODE, cause, unreachable=lost))
        except (CoordinatorError, ValueError) as e:
            self._notice(f"job {spec.job!r}: could not report the cut link to the coordinator: {e}")
            return False, None
        if not reply.left_job:
            return False, None
        ranks.stop(grace=min(spec.stop_grace, FENCE_TERM_S))  # before the coordinator's fence ends
        flush()
        message = (f"this node cannot reach {where} on the data plane ({cause}); of the nodes of a cut link, the "
                   "coordinator went on without this one")
        if rejoin_after_left(spec.job, message, restarts_left, self._notice):
            self._notice(f"job {spec.job!r}: waiting for {where} to answer again before re-joining (up to "
                         f"--join-timeout, {spec.join_timeout:g} s)")
            if links.wait_reachable(lost, spec.join_timeout, self._stop.is_set):
                return True, None
            message = f"{message}; the link did not work again within --join-timeout ({spec.join_timeout:g} s)"
        return True, JobOutcome(JOB_FAILED_ELSEWHERE_EXIT_CODE, f"{message}; job {spec.job!r} goes on without this "
                                "node (live recovery)")


def tell_accused(job: str, ranks: LocalRanks, local: list[int], stacks: Callable[[int], str], notice: Notice) -> None:
    """Before stopping them: the stacks (or state) of the local ranks that are still running although a failed
    rank failed waiting for them (a timeout naming them): what they were doing instead."""
    exits = ranks.exits()
    running = {r for r, pid in zip(local, ranks.local_pids()) if pid}
    for rank in sorted(running):
        waiting = sorted(e.rank for e in exits if e.exit_code != 0 and blamed(e) == rank)
        if waiting:
            who = ", ".join(map(str, waiting))
            notice(f"job {job!r}: rank {rank}, which rank(s) {who} failed waiting for: "
                         f"{stacks(rank)}")
