"""The coordinator's state machine: plain, typed, thread-safe, driven with explicit `now`.

Every method takes the lock, validates its input, mutates and returns, raising the domain
exceptions of `axond.coordinator.errors`; nothing here blocks. Callers that wait (the gRPC
servicer, tests) poll the non-blocking methods again when the `listener` reports a change to a
topic they care about:

* ``("job", name)``: rendezvous frozen, generation bumped, job state changed;
* ``("events", name)``: new output or notices for StreamJob;
* ``("key", name, generation, key)``: a store key was set;
* ``("barrier", name, generation, barrier)``: a barrier completed;
* ``("work", node_id)``: a daemon has assignments or cancellations;
* ``("timer",)``: a new time-based deadline exists (call `tick`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from axond.coordinator.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    check_at_most,
    check_name,
    check_positive,
    short,
)
from axond.coordinator.jobs import EventLog, FinishedEvent, InfoEvent, Job, JobState
from axond.coordinator.kv import ByteBudget, KvSpace
from axond.coordinator.kv_ops import KvOps
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.membership import Liveness, Membership, Node
from axond.coordinator.persistence.base import Persistence
from axond.coordinator.persistence.journal import Journal, TxLock, restore
from axond.coordinator.rendezvous import Member, Round
from axond.coordinator.scheduling import Scheduler
from axond.coordinator.status import StatusSnapshot, snapshot
from axond.coordinator.submitted import SubmittedJobs

Topic = tuple[Hashable, ...]


@dataclass(frozen=True)
class Assignment:
    """What Join answers once the generation is frozen."""

    generation: int
    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    local_world_size: int
    job_secret: bytes
    restarts_left: int


@dataclass(frozen=True)
class HeartbeatResult:
    generation: int
    state: JobState | None
    reason: str


class CoordinatorState(KvOps, SubmittedJobs):
    """Nodes, jobs, rendezvous rounds, KV spaces and placement, behind one lock."""

    def __init__(
        self,
        heartbeat_interval: float = 1.0,
        dead_after_missed: int = 5,
        settle_time: float = 0.5,
        listener: Callable[[Topic], None] | None = None,
        limits: CoordinatorLimits | None = None,
        persistence: Persistence | None = None,
    ) -> None:
        """`persistence`: where every call's changes are committed before it returns, and from which the
        state is restored here (None: kept in this process only)."""
        if heartbeat_interval <= 0 or dead_after_missed < 1 or settle_time < 0:
            raise ValueError(
                f"heartbeat_interval ({heartbeat_interval}) must be > 0, dead_after_missed "
                f"({dead_after_missed}) >= 1 and settle_time ({settle_time}) >= 0"
            )
        self.limits = limits or CoordinatorLimits()
        self.limits.validate()
        self.budget = ByteBudget(self.limits.max_store_bytes)
        self.settle_time = settle_time
        self.members = Membership(Liveness(heartbeat_interval, dead_after_missed), self.limits)
        self.jobs: dict[str, Job] = {}
        self.scheduler = Scheduler()
        self._waiting_next: dict[str, dict[str, tuple[tuple[str, int], int]]] = {}
        self._listener = listener or (lambda topic: None)
        self._job_seq = 0
        self.persistence = persistence
        self.journal: Journal | None = None
        self.lock: threading.RLock | TxLock = threading.RLock()
        if persistence is not None:
            self.journal = Journal()
            restore(self, persistence.load(), time.monotonic())
            self.members.track = True
            self.lock = TxLock(self._commit)

    def _commit(self) -> None:
        """Write what the current call changed (under the lock, before the caller hears of it)."""
        assert self.journal is not None and self.persistence is not None
        changes = self.journal.changes(self, time.monotonic())
        if changes:
            try:
                self.persistence.commit(changes)
            except Exception as e:
                raise Unavailable(
                    f"the coordinator could not write its state ({type(e).__name__}: {e}); retry, and check "
                    "its state directory (disk full? permissions?)"
                ) from e

    def _mark_job(self, name: str) -> None:
        if self.journal is not None:
            self.journal.jobs.add(name)

    def _mark_meta(self) -> None:
        if self.journal is not None:
            self.journal.meta = True

    def _mark_kv(self, job: str, key: str) -> None:
        if self.journal is not None:
            self.journal.kv.add((job, key))

    def _store_cleared(self, job: str) -> None:
        if self.journal is not None:
            self.journal.store_cleared(job)

    def _mark_barrier(self, job: str, name: str) -> None:
        if self.journal is not None:
            self.journal.barriers.add((job, name))

    def listen(self, listener: Callable[[Topic], None]) -> None:
        """Report changed topics to `listener` (the servicer's wake-ups)."""
        self._listener = listener

    def _notify(self, *topic: Hashable) -> None:
        if self.journal is not None:
            kind = topic[0]
            if kind in ("job", "events"):
                self.journal.jobs.add(topic[1])  # type: ignore[arg-type]
            elif kind == "key":
                self.journal.kv.add((topic[1], topic[3]))  # type: ignore[arg-type]
            elif kind == "work":
                self.journal.meta = True
        self._listener(topic)

    def _job(self, name: str) -> Job:
        if not name:
            raise InvalidArgument("job must be a non-empty name")
        job = self.jobs.get(name)
        if job is None:
            raise NotFound(f"unknown job {short(name)}: check the name with `axond status`")
        return job

    def _new_space(self) -> KvSpace:
        return KvSpace(self.limits, self.budget)

    def _new_job(self, name: str, min_nodes: int, max_nodes: int, max_restarts: int) -> Job:
        """Record a new job at generation 1, first forgetting old records if the job table is full."""
        old = self.jobs.pop(name, None)
        if old is not None:
            old.kv.release()
        if self.journal is not None:
            self.journal.job_replaced(name)
        if len(self.jobs) >= self.limits.max_jobs:
            self._forget_jobs()
        j = Job(
            name, min_nodes, max_nodes, max_restarts, self._new_round(1, min_nodes, max_nodes), kv=self._new_space(),
            events=EventLog(self.limits.max_output_bytes_per_job),
        )
        self.jobs[name] = j
        return j

    def _forget_jobs(self) -> None:
        """Drop finished and abandoned jobs, oldest first, until there is room for one more."""
        def abandoned(j: Job) -> bool:
            return j.spec is None and not j.round.frozen and not j.round.joiners and not self._waiting_next.get(j.name)

        candidates = [j for j in self.jobs.values() if j.state.terminal or abandoned(j)]
        candidates.sort(key=lambda j: (not j.state.terminal, j.finished_at or 0.0))
        for j in candidates[: len(self.jobs) - self.limits.max_jobs + 1]:
            j.kv.release()
            del self.jobs[j.name]
            self._mark_job(j.name)
            self._waiting_next.pop(j.name, None)
        if len(self.jobs) >= self.limits.max_jobs:
            raise ResourceExhausted(
                f"the coordinator holds {len(self.jobs)} active jobs, its limit (max_jobs); "
                "cancel finished work or raise the limit"
            )

    def _new_round(self, generation: int, min_nodes: int, max_nodes: int) -> Round:
        return Round(generation, min_nodes, max_nodes, self.settle_time, secrets.token_bytes(16))

    def register_node(self, hostname: str, slots: int, daemon: bool, now: float) -> Node:
        with self.lock:
            node = self.members.register(hostname, slots, daemon, now)
            self._mark_meta()
            if daemon:
                self._place()
            return node

    def authenticate(self, node_id: str, secret: str) -> None:
        """Raise PermissionDenied unless `secret` is the node's own (NotFound for unknown nodes)."""
        with self.lock:
            self.members.authenticate(node_id, secret)

    def heartbeat(
        self, node_id: str, job: str, generation: int, now: float, local_pids: tuple[int, ...] = ()
    ) -> HeartbeatResult:
        with self.lock:
            node, _ = self.members.touch(node_id, now)
            if local_pids:
                check_at_most("local_pids", len(local_pids), self.limits.max_nproc_per_node, "max_nproc_per_node")
                node.local_pids = tuple(local_pids)
            if not job:
                return HeartbeatResult(0, None, "")
            j = self._job(job)
            return HeartbeatResult(j.generation, j.state, j.reason)

    def deregister_node(self, node_id: str, now: float) -> None:
        with self.lock:
            node = self.members.get(node_id)
            self._node_lost(node, "deregistered", now)
            self.members.remove(node_id)
            self.scheduler.forget_node(node_id)

    def _node_lost(self, node: Node, why: str, now: float) -> None:
        for job in list(self.jobs.values()):
            self._waiting_next.get(job.name, {}).pop(node.node_id, None)
            if job.state.terminal:
                continue
            if job.round.remove(node.node_id):
                self._notify("job", job.name)
            lost_assigned = node.node_id in job.assigned and job.round.member(node.node_id) is None
            if job.active_member(node.node_id) or lost_assigned:
                if node.node_id in job.assigned:
                    job.assigned.remove(node.node_id)
                    self.scheduler.enqueue(job.name)
                self._bump(job, f"node {node.node_id} ({node.hostname}) {why}", True, 1, now)
        self._place()

    def tick(self, now: float) -> float | None:
        """Apply time-based transitions (dead nodes, settled rendezvous); returns the next deadline."""
        with self.lock:
            interval = self.members.liveness.heartbeat_interval
            for node in self.members.newly_dead(now):
                missed = self.members.liveness.dead_after_missed
                self._node_lost(node, f"missed {missed} heartbeats ({missed * interval:.1f} s)", now)
            deadlines = []
            for job in self.jobs.values():
                self._maybe_freeze(job, now)
                at = job.round.freeze_at()
                if at is not None:
                    deadlines.append(at)
            return min(deadlines) if deadlines else None

    def join(
        self, job: str, node_id: str, nproc: int, min_nodes: int, max_nodes: int, max_restarts: int, now: float
    ) -> Assignment | None:
        """Enter the job's rendezvous; returns the assignment once frozen, None while it is open."""
        with self.lock:
            check_name("job", job, self.limits.max_name_chars)
            check_positive("nproc", nproc)
            check_positive("min_nodes", min_nodes)
            check_at_most("nproc", nproc, self.limits.max_nproc_per_node, "max_nproc_per_node")
            check_at_most("nnodes MAX", max_nodes, self.limits.max_nnodes, "max_nnodes")
            if max_nodes < min_nodes:
                raise InvalidArgument(f"nnodes {min_nodes}:{max_nodes}: MIN must be <= MAX")
            if max_restarts < 0:
                raise InvalidArgument(f"max_restarts is {max_restarts}; it must be >= 0")
            node, _ = self.members.touch(node_id, now)
            j = self.jobs.get(job)
            if j is None or (j.state.terminal and j.spec is None):
                j = self._new_job(job, min_nodes, max_nodes, max_restarts)
            self._check_join(j, node, min_nodes, max_nodes, max_restarts)
            pending = sum(x.nproc for nid, x in j.round.joiners.items() if nid != node_id)
            if pending + nproc > self.limits.max_world_size:
                raise InvalidArgument(
                    f"job {short(job)} would have more than {self.limits.max_world_size} ranks (max_world_size)"
                )
            node.job = job
            self.members.mark(node)
            self._mark_job(job)
            rnd = j.round
            if rnd.frozen:
                if rnd.member(node_id) is not None:
                    if node_id in j.exits:
                        raise FailedPrecondition(
                            f"node {node_id} already finished generation {j.generation} of job {job!r}"
                        )
                    return self._assignment(j, node_id)
                self._waiting_next.setdefault(job, {})[node_id] = (node.order_key, nproc)
                if len(rnd.members or []) < j.max_nodes:
                    self._bump(j, f"node {node_id} ({node.hostname}) joined; re-forming with more nodes", False, 0, now)
                return None
            rnd.add(node_id, node.order_key, nproc, now)
            if rnd.freeze_at() is not None:
                self._notify("timer")
            self._maybe_freeze(j, now)
            return self._assignment(j, node_id) if rnd.member(node_id) else None

    def _check_join(self, j: Job, node: Node, min_nodes: int, max_nodes: int, max_restarts: int) -> None:
        if j.state.terminal:
            raise FailedPrecondition(f"job {j.name!r} has finished ({j.state.name}); submit it again")
        if (j.min_nodes, j.max_nodes) != (min_nodes, max_nodes) or j.max_restarts != max_restarts:
            raise FailedPrecondition(
                f"job {j.name!r} runs with nnodes {j.min_nodes}:{j.max_nodes} and max_restarts {j.max_restarts}, "
                f"this worker asks {min_nodes}:{max_nodes} and {max_restarts}; pass the same options "
                "to every worker or use another --job name"
            )
        if j.spec is not None and node.node_id not in j.assigned:
            raise FailedPrecondition(
                f"job {j.name!r} was submitted with `axond run` and runs only on its assigned daemons"
            )

    def join_result(self, job: str, node_id: str, now: float, since: int = 0) -> Assignment | None:
        """Poll a pending Join: the assignment, None to keep waiting, or an error if dropped.

        `since` is the generation the Join started in: if a generation >= since froze with this
        node and then already moved on, its assignment is still returned (the node learns of the
        newer generation from its heartbeat and joins again).
        """
        with self.lock:
            j = self._job(job)
            if j.state.terminal:
                raise FailedPrecondition(f"job {job!r} finished ({j.state.name}) while this node waited to join")
            self._maybe_freeze(j, now)
            if j.round.member(node_id) is not None and node_id not in j.exits:
                return self._assignment(j, node_id)
            for old in reversed(j.past_rounds):
                m = old.member(node_id)
                if old.generation >= since and m is not None:
                    return Assignment(
                        old.generation, m.node_rank, len(old.members or []), m.rank_offset, old.world_size, m.nproc,
                        old.secret, j.restarts_left,
                    )
            if node_id in j.round.joiners or node_id in self._waiting_next.get(job, {}):
                return None
            raise FailedPrecondition(
                f"node {node_id} is no longer in the rendezvous of job {job!r} (generation {j.generation}); "
                "it was declared dead or the generation moved on: join again"
            )

    def leave_rendezvous(self, job: str, node_id: str) -> None:
        """A Join gave up waiting: drop the node from the open round."""
        with self.lock:
            j = self.jobs.get(job)
            if j is not None:
                self._waiting_next.get(job, {}).pop(node_id, None)
                j.round.remove(node_id)
                self._mark_job(job)

    def _maybe_freeze(self, j: Job, now: float) -> None:
        if j.state.terminal or not j.round.maybe_freeze(now):
            return
        j.state = JobState.RUNNING
        left = self._waiting_next.setdefault(j.name, {})
        for node_id, joiner in j.round.joiners.items():
            if j.round.member(node_id) is None:
                left[node_id] = (joiner.order_key, joiner.nproc)
        j.events.append(InfoEvent(f"generation {j.generation}: {len(j.round.members or [])} nodes, world size {j.round.world_size}"))
        self._notify("job", j.name)
        self._notify("events", j.name)

    def _assignment(self, j: Job, node_id: str) -> Assignment:
        m: Member | None = j.round.member(node_id)
        if m is None:
            raise FailedPrecondition(f"node {node_id} is not a member of generation {j.generation} of job {j.name!r}")
        return Assignment(
            j.generation, m.node_rank, len(j.round.members or []), m.rank_offset, j.round.world_size, m.nproc,
            j.round.secret, j.restarts_left,
        )

    def _bump(self, j: Job, reason: str, count_restart: bool, exit_code: int, now: float) -> bool:
        """Open the next generation (survivors re-join); fail the job when restarts run out."""
        if count_restart and j.restarts >= j.max_restarts:
            self._finish(
                j, JobState.FAILED, exit_code or 1, f"{reason}; no restarts left (max_restarts {j.max_restarts})", now
            )
            return False
        if count_restart:
            j.restarts += 1
        j.reason = reason
        j.past_rounds = [*j.past_rounds[-3:], j.round]
        j.round = self._new_round(j.generation + 1, j.min_nodes, j.max_nodes)
        j.kv.release()
        j.kv = self._new_space()
        self._store_cleared(j.name)
        j.exits.clear()
        j.state = JobState.RESTARTING
        now_waiting = self._waiting_next.pop(j.name, {})
        for node_id, (key, nproc) in now_waiting.items():
            j.round.add(node_id, key, nproc, now)
        j.events.append(InfoEvent(f"restarting as generation {j.generation}: {reason}"))
        self._notify("job", j.name)
        self._notify("events", j.name)
        self._notify("timer")
        return True

    def _finish(self, j: Job, state: JobState, exit_code: int, message: str, now: float) -> None:
        if state is not JobState.SUCCEEDED:
            j.round = self._new_round(j.generation + 1, j.min_nodes, j.max_nodes)
            j.kv.release()
            j.kv = self._new_space()
            self._store_cleared(j.name)
        j.state, j.exit_code, j.reason, j.finished_at = state, exit_code, message, now
        self._waiting_next.pop(j.name, None)
        j.events.append(FinishedEvent(exit_code, message))
        for node in self.members.nodes.values():
            if node.job == j.name:
                node.job = ""
                self.members.mark(node)
        if state is JobState.CANCELLED:
            for node_id in self.scheduler.cancel(j):
                self._notify("work", node_id)
        self._notify("job", j.name)
        self._notify("events", j.name)
        self._place()

    @staticmethod
    def _is_current(j: Job, node_id: str, generation: int) -> bool:
        """Validate a report about `generation` of `j`: False if it is stale (older, or the job ended)."""
        if generation > j.generation:
            raise InvalidArgument(f"generation {generation} of job {j.name!r} does not exist (current {j.generation})")
        if generation < j.generation or j.state.terminal:
            return False
        if j.round.member(node_id) is None:
            raise FailedPrecondition(f"node {node_id} is not a member of generation {generation} of job {j.name!r}")
        return True

    def report_failure(
        self, job: str, node_id: str, generation: int, rank: int, exit_code: int, message: str, now: float
    ) -> tuple[int, bool]:
        """A rank or agent failed: bump the generation; returns (new generation, will_restart)."""
        with self.lock:
            j = self._job(job)
            node, _ = self.members.touch(node_id, now)
            if not self._is_current(j, node_id, generation):
                return j.generation, not j.state.terminal
            if not -1 <= rank < j.round.world_size:
                raise InvalidArgument(f"rank {rank} is outside 0..{j.round.world_size - 1} (or -1 for the agent)")
            who = f"rank {rank}" if rank >= 0 else "the agent"
            detail = f": {message[:500]}" if message else ""
            reason = f"{who} on node {node_id} ({node.hostname}) failed with exit code {exit_code}{detail}"
            will = self._bump(j, reason, True, exit_code, now)
            return j.generation, will

    def report_exit(self, job: str, node_id: str, generation: int, exit_code: int, now: float) -> None:
        """The node's local ranks of `generation` all exited; the job ends when every node did."""
        with self.lock:
            j = self._job(job)
            node, _ = self.members.touch(node_id, now)
            if not self._is_current(j, node_id, generation):
                return
            j.exits[node_id] = exit_code
            node.job = ""
            self.members.mark(node)
            self._mark_job(job)
            if exit_code != 0:
                self._finish(
                    j, JobState.FAILED, exit_code, f"node {node_id} ({node.hostname}) exited with code {exit_code}", now
                )
            elif len(j.exits) == len(j.round.members or []):
                self._finish(j, JobState.SUCCEEDED, 0, "every rank exited 0", now)

    def status(self, job: str, now: float, all: bool = False, max_ranks: int = 0) -> StatusSnapshot:
        """Nodes and jobs for `axond status`: bounded work (at most `max_ranks` ranks listed per job).

        Without `all`, finished jobs and dead nodes older than the retention time are left out.
        """
        with self.lock:
            limits = self.limits
            ranks = min(max_ranks or limits.default_status_ranks, limits.max_status_ranks)
            if job:
                jobs = [self._job(job)]
            else:
                jobs = sorted(self.jobs.values(), key=lambda j: j.name)
                if not all:
                    jobs = [j for j in jobs if j.finished_at is None or now - j.finished_at <= limits.status_retention_s]
            return snapshot(self.members, jobs, now, ranks, None if all else limits.status_retention_s)

    def rendezvous_progress(self, job: str) -> str:
        """A short description of an open rendezvous, for timeout messages."""
        with self.lock:
            j = self.jobs.get(job)
            if j is None:
                return "the job no longer exists"
            return (
                f"generation {j.generation}: {len(j.round.joiners)} node(s) joined, "
                f"nnodes {j.min_nodes}:{j.max_nodes}, state {j.state.name}"
            )
