"""The coordinator's state machine: plain, typed, thread-safe, driven with explicit `now`.

`CoordinatorState` is a thin facade: each method takes the lock and calls one or two components,
each a plain class owning its part of the state:

* `Membership` (membership.py): registered nodes, heartbeats, failure detection;
* `JobLifecycle` (lifecycle.py): rendezvous rounds, generations, restarts and the job's end;
* `JobFailures` (failures.py): lost nodes, failure and exit reports, live recovery's re-formation;
* `JobKv` (job_kv.py): the per-job, per-generation KV store and barriers;
* `Scheduler` (scheduling.py): placement of submitted jobs on worker daemons;
* `SubmittedJobs` (submitted.py): `axond run` jobs, daemon work, output and cancel.

What they share (the job table, the limits, wake-ups, marks for the durable state) is one
`StateContext` (context.py) handed to each. Nothing here blocks; every method validates its input,
mutates and returns, raising the domain exceptions of `axond.coordinator.state.errors`. Callers that wait
(the gRPC servicer, tests) poll the non-blocking methods again when the `listener` reports a change
to a topic they care about:

* ``("job", name)``: rendezvous frozen, generation bumped, job state changed;
* ``("events", name)``: new output or notices for StreamJob;
* ``("key", name, generation, key)``: a store key was set;
* ``("barrier", name, generation, barrier)``: a barrier completed;
* ``("work", node_id)``: a daemon has assignments or cancellations;
* ``("timer",)``: a new time-based deadline exists (call `tick`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
import threading
import time
from collections.abc import Callable, Sequence

from axond.coordinator.state.context import StateContext, Topic
from axond.coordinator.state.errors import StateError, Unavailable
from axond.coordinator.state.failures import JobFailures
from axond.coordinator.state.linkcut import LinkCuts
from axond.coordinator.state.job_kv import JobKv
from axond.coordinator.state.jobs import Event, Job, JobSpec
from axond.coordinator.state.kv_space import ByteBudget
from axond.coordinator.state.lifecycle import Assignment, HeartbeatResult, JobLifecycle
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.state.membership import Liveness, Membership, Node
from axond.coordinator.state.port import Changes, Persistence
from axond.coordinator.state.journal import Journal, TxLock, restore
from axond.coordinator.state.scheduling import Scheduler
from axond.coordinator.state.status import StatusSnapshot, snapshot
from axond.fencing import FENCE_MARGIN_S, check_fence_margin
from axond.coordinator.state.submitted import SubmittedJobs


class CoordinatorState:
    """Nodes, jobs, rendezvous rounds, KV spaces and placement, behind one lock."""

    def __init__(
        self,
        heartbeat_interval: float = 1.0,
        dead_after_missed: int = 5,
        settle_time: float = 0.5,
        fence_margin: float = FENCE_MARGIN_S,
        listener: Callable[[Topic], None] | None = None,
        limits: CoordinatorLimits | None = None,
        persistence: Persistence | None = None,
    ) -> None:
        """`persistence`: where every call's changes are committed before it returns (or, after
        `commit_later`, by a group committer), and from which the state is restored here (None: kept in
        this process only)."""
        if heartbeat_interval <= 0 or dead_after_missed < 1 or settle_time < 0:
            raise ValueError(
                f"heartbeat_interval ({heartbeat_interval}) must be > 0, dead_after_missed "
                f"({dead_after_missed}) >= 1 and settle_time ({settle_time}) >= 0"
            )
        check_fence_margin(fence_margin)
        self.limits = limits or CoordinatorLimits()
        self.limits.validate()
        self.kv_ops: Counter[str] = Counter()
        """KV and barrier calls served, by operation (for /metrics; counted by KvCalls)."""
        self.ctx = StateContext(self.limits, listener)
        self.members = Membership(Liveness(heartbeat_interval, dead_after_missed, self.limits.max_heartbeat_rate),
                                  self.limits)
        self.scheduler = Scheduler(self.members, self.ctx)
        self.lifecycle = JobLifecycle(self.members, self.scheduler, self.ctx, settle_time)
        self.failures = JobFailures(self.members, self.lifecycle, self.scheduler, self.ctx, fence_margin)
        self.link_cuts = LinkCuts(self.failures)
        self.kv = JobKv(self.ctx)
        self.submitted = SubmittedJobs(self.members, self.lifecycle, self.scheduler, self.ctx)
        self.persistence = persistence
        self.lock: threading.RLock | TxLock = threading.RLock()
        if persistence is not None:
            self.ctx.journal = Journal()
            restore(self, persistence.load(), time.monotonic())
            self.members.track = True
            self.lock = TxLock(self._commit)

    @property
    def jobs(self) -> dict[str, Job]:
        """The job table, by name (read it under `lock`)."""
        return self.ctx.jobs

    @property
    def budget(self) -> ByteBudget:
        """Bytes held by every job's KV space together."""
        return self.ctx.budget

    @property
    def journal(self) -> Journal | None:
        return self.ctx.journal

    def _commit(self) -> None:
        """Write what the current call changed (under the lock, before the caller hears of it)."""
        assert self.persistence is not None
        changes = self.take_changes()
        if changes:
            try:
                self.persistence.commit(changes)
            except Exception as e:
                assert self.ctx.journal is not None
                for job in changes.joiners:  # not written: the next commit writes these rounds' joiners whole
                    self.ctx.journal.rounds_saved.pop(job, None)
                    self.ctx.journal.past_saved.pop(job, None)
                raise Unavailable(
                    f"the coordinator could not write its state ({type(e).__name__}: {e}); retry, and check "
                    "its state directory (disk full? permissions?)"
                ) from e

    def uncommitted(self) -> bool:
        """Whether changes wait to be committed (call under `lock`; False when not durable)."""
        journal = self.ctx.journal
        return journal is not None and journal.marked(self)

    def take_changes(self) -> Changes:
        """Everything changed since the last call of this, read from the live objects (call under `lock`)."""
        assert self.ctx.journal is not None, "take_changes needs a durable state"
        return self.ctx.journal.changes(self, time.monotonic())

    def commit_later(self, on_change: Callable[[], None]) -> None:
        """Group commit: at the end of each call call `on_change` (under the lock) instead of committing;
        whoever passes it commits `take_changes()` itself (see persistence/group_commit.py)."""
        if not isinstance(self.lock, TxLock):
            raise ValueError("commit_later needs a durable state (one made with a persistence)")
        self.lock.on_release = on_change

    def listen(self, listener: Callable[[Topic], None]) -> None:
        """Report changed topics to `listener` (the servicer's wake-ups)."""
        self.ctx.listen(listener)

    def register_node(self, hostname: str, slots: int, daemon: bool, now: float) -> Node:
        with self.lock:
            node = self.members.register(hostname, slots, daemon, now)
            self.ctx.mark_meta()
            if daemon:
                self.scheduler.place()
            return node

    def authenticate(self, node_id: str, secret: str) -> None:
        """Raise PermissionDenied unless `secret` is the node's own (NotFound for unknown nodes)."""
        with self.lock:
            self.members.authenticate(node_id, secret)

    def heartbeat(
        self, node_id: str, job: str, generation: int, now: float, local_pids: tuple[int, ...] = (),
        renew: bool = True,
    ) -> HeartbeatResult:
        """Renew the node's lease (unless not `renew`) and answer what it runs."""
        with self.lock:
            try:
                answer = self.lifecycle.heartbeat(job)  # validates the job first: pids are kept only for real ones
            except StateError:
                self.members.heartbeat(node_id, now, (), renew)
                raise
            pids = local_pids if answer.state is not None and not answer.state.terminal else ()
            node = self.members.heartbeat(node_id, now, pids, renew, job, generation)
            live = answer.live and not self.failures.left_job(job, node_id)  # live recovery went on without it
            return dataclasses.replace(answer, interval=node.interval, live=live)

    def rearm_leases(self, away: float, now: float) -> int:
        """The coordinator was not running for `away` seconds: count none of it against any lease."""
        with self.lock:
            return self.members.rearm(away, now)

    def deregister_node(self, node_id: str, now: float) -> None:
        with self.lock:
            node = self.members.get(node_id)
            self.failures.node_lost(node, "deregistered", now)
            self.members.remove(node_id)
            self.scheduler.forget_node(node_id)

    def tick(self, now: float) -> float | None:
        """Apply time-based transitions (dead nodes, settled rendezvous); returns the next deadline."""
        with self.lock:
            for node in self.members.newly_dead(now):
                missed = self.members.liveness.dead_after_missed
                silent = missed * self.members.paced(node)
                self.failures.node_lost(node, f"missed {missed} heartbeats ({silent:.1f} s)", now, dead=True)
            return self.lifecycle.tick(now)

    def join(
        self, job: str, node_id: str, nproc: int, min_nodes: int, max_nodes: int, max_restarts: int, now: float,
        live: bool = False,
    ) -> Assignment | None:
        """Enter the job's rendezvous; returns the assignment once frozen, None while it is open (`live`: the job
        recovers live, `axond worker --live-recovery`)."""
        with self.lock:
            return self.lifecycle.join(job, node_id, nproc, min_nodes, max_nodes, max_restarts, now, live)

    def join_result(self, job: str, node_id: str, now: float, since: int = 0) -> Assignment | None:
        """Poll a pending Join: the assignment, None to keep waiting, or an error if dropped."""
        with self.lock:
            return self.lifecycle.join_result(job, node_id, now, since)

    def leave_rendezvous(self, job: str, node_id: str) -> None:
        """A Join gave up waiting: drop the node from the open round."""
        with self.lock:
            self.lifecycle.leave_rendezvous(job, node_id)

    def rendezvous_progress(self, job: str) -> str:
        """A short description of an open rendezvous, for timeout messages."""
        with self.lock:
            return self.lifecycle.rendezvous_progress(job)

    def report_failure(
        self, job: str, node_id: str, generation: int, rank: int, exit_code: int, message: str, now: float,
        unreachable: Sequence[int] = (),
    ) -> tuple[int, bool]:
        """A rank or agent failed: bump the generation; returns (new generation, will_restart). `unreachable`: the
        node's ranks run but cannot reach these node ranks (a live job's cut link, `LinkCuts`)."""
        with self.lock:
            if unreachable:
                return self.link_cuts.report(job, node_id, generation, unreachable, message, now)
            return self.failures.report_failure(job, node_id, generation, rank, exit_code, message, now)

    def left_job(self, job: str, node_id: str) -> bool:
        """Whether live recovery went on without `node_id` (its worker leaves instead of re-joining)."""
        with self.lock:
            return self.failures.left_job(job, node_id)

    def report_exit(self, job: str, node_id: str, generation: int, exit_code: int, now: float) -> None:
        """The node's local ranks of `generation` all exited; the job ends when every node did."""
        with self.lock:
            self.failures.report_exit(job, node_id, generation, exit_code, now)

    def status(self, job: str, now: float, all: bool = False, max_ranks: int = 0) -> StatusSnapshot:
        """Nodes and jobs for `axond status`: bounded work (at most `max_ranks` ranks listed per job).

        Without `all`, finished jobs and dead nodes older than the retention time are left out.
        """
        with self.lock:
            limits = self.limits
            ranks = min(max_ranks or limits.default_status_ranks, limits.max_status_ranks)
            if job:
                jobs = [self.ctx.job(job)]
            else:
                jobs = sorted(self.jobs.values(), key=lambda j: j.name)
                if not all:
                    jobs = [j for j in jobs if j.finished_at is None or now - j.finished_at <= limits.status_retention_s]
            return snapshot(self.members, jobs, now, ranks, None if all else limits.status_retention_s,
                            self.ctx.goodput)

    def kv_set(self, job: str, generation: int, key: str, value: bytes) -> None:
        with self.lock:
            self.kv.set(job, generation, key, value)

    def kv_get(self, job: str, generation: int, key: str) -> bytes | None:
        with self.lock:
            return self.kv.get(job, generation, key)

    def kv_add(self, job: str, generation: int, key: str, delta: int, request_id: str = "") -> int:
        with self.lock:
            return self.kv.add(job, generation, key, delta, request_id)

    def kv_compare_set(
        self, job: str, generation: int, key: str, expected: bytes | None, desired: bytes, request_id: str = ""
    ) -> tuple[bool, bytes | None]:
        with self.lock:
            return self.kv.compare_set(job, generation, key, expected, desired, request_id)

    def kv_delete(self, job: str, generation: int, key: str) -> bool:
        with self.lock:
            return self.kv.delete(job, generation, key)

    def kv_missing(self, job: str, generation: int, keys: list[str]) -> list[str]:
        """The keys not set yet (validates them all)."""
        with self.lock:
            return self.kv.missing(job, generation, keys)

    def barrier_arrive(self, job: str, generation: int, name: str, world_size: int, arrival: str) -> bool:
        """Record an arrival; returns whether the barrier is complete."""
        with self.lock:
            return self.kv.arrive(job, generation, name, world_size, arrival)

    def barrier_done(self, job: str, generation: int, name: str) -> bool:
        with self.lock:
            return self.kv.barrier_done(job, generation, name)

    def submit_job(self, name: str, spec: JobSpec, now: float) -> str:
        """Queue a job for placement on worker daemons; returns its name (generated if empty)."""
        with self.lock:
            return self.submitted.submit_job(name, spec, now)

    def take_work(self, node_id: str, now: float) -> tuple[list[tuple[str, JobSpec]], list[str]]:
        """Assignments and cancellations for a daemon, each delivered once."""
        with self.lock:
            return self.submitted.take_work(node_id, now)

    def push_output(self, job: str, node_id: str, lines: list[tuple[int, str, str]]) -> None:
        """Append rank output lines to the job's event log; only the job's own nodes may."""
        with self.lock:
            self.submitted.push_output(job, node_id, lines)

    def read_events(self, job: str, index: int) -> tuple[list[Event], int, int, bool]:
        """Events from `index`: (events, next index, dropped count, whether the job finished)."""
        with self.lock:
            return self.submitted.read_events(job, index)

    def cancel_job(self, job: str, now: float) -> None:
        """Cancel a job (idempotent): agents learn it on their next heartbeat, daemons on PollWork."""
        with self.lock:
            self.submitted.cancel_job(job, now)
