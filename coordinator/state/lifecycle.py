"""Jobs from rendezvous to their end: join, freeze, generations, restarts and the job's end.

Plain and non-blocking; the caller (`CoordinatorState`) holds the lock. A job's first rendezvous
round opens when a node joins (or `axond run` submits it); a failure or a lost node opens the next
generation, whose store starts empty, until restarts run out. Which failures, losses and exits do that,
and live recovery's re-formation with the survivors, is `JobFailures`' (failures.py), calling `bump` and
`finish` here.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from axond.coordinator.state.context import StateContext
from axond.coordinator.state.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    check_at_most,
    check_name,
    check_positive,
    short,
)
from axond.coordinator.state.growth import charge_rejoin, grow_live
from axond.coordinator.state.jobs import EventLog, FinishedEvent, InfoEvent, Job, JobState
from axond.coordinator.state.membership import Membership, Node
from axond.coordinator.state.rendezvous import Member, Round
from axond.coordinator.state.scheduling import Scheduler


REFUSED = "refused a worker"
"""How a pending job's reason starts after a worker asking for other options was refused (cleared at freeze)."""


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
    interval: float = 0.0
    """The heartbeat interval the node is told to keep (0: unchanged)."""
    live: bool = False
    """`generation` was opened by live recovery: its survivors keep their ranks running and re-join."""


class JobLifecycle:
    """Every job's rounds and generations, and the nodes waiting for a job's next generation."""

    def __init__(self, members: Membership, scheduler: Scheduler, ctx: StateContext, settle_time: float) -> None:
        self.members = members
        self.scheduler = scheduler
        self.ctx = ctx
        self.settle_time = settle_time
        self.waiting_next: dict[str, dict[str, tuple[tuple[str, int], int]]] = {}
        """Per job: nodes that joined a frozen generation, by id -> (rank order key, nproc)."""

    def new_job(self, name: str, min_nodes: int, max_nodes: int, max_restarts: int, live: bool = False) -> Job:
        """Record a new job at generation 1, first forgetting old records if the job table is full."""
        ctx = self.ctx
        old = ctx.jobs.pop(name, None)
        if old is not None:
            old.kv.release()
        ctx.job_replaced(name)
        if len(ctx.jobs) >= ctx.limits.max_jobs:
            self._forget_jobs()
        j = Job(
            name, min_nodes, max_nodes, max_restarts, self._new_round(1, min_nodes, max_nodes), kv=ctx.new_space(),
            events=EventLog(ctx.limits.max_output_bytes_per_job), live=live,
        )
        ctx.jobs[name] = j
        return j

    def _forget_jobs(self) -> None:
        """Drop finished and abandoned jobs, oldest first, until there is room for one more."""
        jobs, max_jobs = self.ctx.jobs, self.ctx.limits.max_jobs

        def abandoned(j: Job) -> bool:
            return j.spec is None and not j.round.frozen and not j.round.joiners and not self.waiting_next.get(j.name)

        candidates = [j for j in jobs.values() if j.state.terminal or abandoned(j)]
        candidates.sort(key=lambda j: (not j.state.terminal, j.finished_at or 0.0))
        for j in candidates[: len(jobs) - max_jobs + 1]:
            j.kv.release()
            del jobs[j.name]
            self.ctx.mark_job(j.name)
            self.waiting_next.pop(j.name, None)
        if len(jobs) >= max_jobs:
            raise ResourceExhausted(
                f"the coordinator holds {len(jobs)} active jobs, its limit (max_jobs); "
                "cancel finished work or raise the limit"
            )

    def _new_round(self, generation: int, min_nodes: int, max_nodes: int) -> Round:
        return Round(generation, min_nodes, max_nodes, self.settle_time, secrets.token_bytes(16))

    def heartbeat(self, job: str) -> HeartbeatResult:
        """What a heartbeat answers about `job` (empty: the node runs none)."""
        if not job:
            return HeartbeatResult(0, None, "")
        j = self.ctx.job(job)
        return HeartbeatResult(j.generation, j.state, j.reason, live=j.live and j.live_generation == j.generation)

    def tick(self, now: float) -> float | None:
        """Freeze the rounds that settled; returns the next time a round freezes on its own."""
        deadlines = []
        for job in self.ctx.jobs.values():
            self._maybe_freeze(job, now)
            at = job.round.freeze_at()
            if at is not None:
                deadlines.append(at)
        return min(deadlines) if deadlines else None

    def join(
        self, job: str, node_id: str, nproc: int, min_nodes: int, max_nodes: int, max_restarts: int, now: float,
        live: bool = False,
    ) -> Assignment | None:
        """Enter the job's rendezvous; returns the assignment once frozen, None while it is open."""
        limits = self.ctx.limits
        check_name("job", job, limits.max_name_chars)
        check_positive("nproc", nproc)
        check_positive("min_nodes", min_nodes)
        check_at_most("nproc", nproc, limits.max_nproc_per_node, "max_nproc_per_node")
        check_at_most("nnodes MAX", max_nodes, limits.max_nnodes, "max_nnodes")
        if max_nodes < min_nodes:
            raise InvalidArgument(f"nnodes {min_nodes}:{max_nodes}: MIN must be <= MAX")
        if max_restarts < 0:
            raise InvalidArgument(f"max_restarts is {max_restarts}; it must be >= 0")
        node, _ = self.members.touch(node_id, now)
        j = self.ctx.jobs.get(job)
        if j is None or (j.state.terminal and j.spec is None):
            j = self.new_job(job, min_nodes, max_nodes, max_restarts, live)
        self._check_join(j, node, min_nodes, max_nodes, max_restarts, live)
        if j.round.frozen and j.round.member(node_id) is None and len(j.round.members or []) >= j.max_nodes:
            raise FailedPrecondition(
                f"job {job!r} is running with all its {j.max_nodes} node(s) (generation {j.generation}), so this "
                "worker cannot join it: use another --job name, or start this worker once the job ended"
            )
        again = j.round.joiners.get(node_id)
        pending = j.round.joined_ranks - (again.nproc if again is not None else 0)
        if pending + nproc > limits.max_world_size:
            raise InvalidArgument(
                f"job {short(job)} would have more than {limits.max_world_size} ranks (max_world_size)"
            )
        rejoins = j.live and node_id in j.left
        if rejoins:
            charge_rejoin(j, node)
        node.job = job
        if rejoins:  # joining again: it is in the job once more
            j.left.remove(node_id)
        self.members.mark(node)
        self.ctx.mark_job(job)
        rnd = j.round
        if rnd.frozen:
            if rnd.member(node_id) is not None:
                if node_id in j.exits:
                    raise FailedPrecondition(
                        f"node {node_id} already finished generation {j.generation} of job {job!r}"
                    )
                return self._assignment(j, node_id)
            self.waiting_next.setdefault(job, {})[node_id] = (node.order_key, nproc)
            if len(rnd.members or []) < j.max_nodes and j.live:  # the running ranks go on, the newcomer joins them
                try:
                    grow_live(j, node, self.members, self.bump, now, rejoins)
                except FailedPrecondition:
                    self.waiting_next[job].pop(node_id, None)
                    node.job = ""
                    raise
            elif len(rnd.members or []) < j.max_nodes:
                self.bump(j, f"node {node_id} ({node.hostname}) joined; re-forming with more nodes", False, 0, now)
            return None
        rnd.add(node_id, node.order_key, nproc, now)
        self.ctx.goodput.observe(job, j, now)
        if rnd.freeze_at() is not None:
            self.ctx.notify("timer")
        self._maybe_freeze(j, now)
        return self._assignment(j, node_id) if rnd.member(node_id) else None

    def _check_join(self, j: Job, node: Node, min_nodes: int, max_nodes: int, max_restarts: int, live: bool) -> None:
        if j.state.terminal:
            raise FailedPrecondition(f"job {j.name!r} has finished ({j.state.name}); submit it again")
        if j.live != live:
            raise FailedPrecondition(
                f"job {j.name!r} runs {'with' if j.live else 'without'} --live-recovery, this worker asks "
                f"{'with' if live else 'without'}; pass the same options to every worker or use another --job name"
            )
        if (j.min_nodes, j.max_nodes) != (min_nodes, max_nodes) or j.max_restarts != max_restarts:
            why = (f"it asked nnodes {min_nodes}:{max_nodes} and max_restarts {max_restarts}, the job has "
                   f"{j.min_nodes}:{j.max_nodes} and {j.max_restarts}")
            if not j.round.frozen:  # the workers waiting in the rendezvous see it in the job's reason
                j.reason = f"{REFUSED} on {node.hostname} ({node.node_id}): {why}"
                self.ctx.mark_job(j.name)
                self.ctx.notify("job", j.name)
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
        j = self.ctx.job(job)
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
        if node_id in j.round.joiners or node_id in self.waiting_next.get(job, {}):
            return None
        raise FailedPrecondition(
            f"node {node_id} is no longer in the rendezvous of job {job!r} (generation {j.generation}); "
            "it was declared dead or the generation moved on: join again"
        )

    def leave_rendezvous(self, job: str, node_id: str, now: float | None = None) -> None:
        """A Join gave up waiting: drop the node from the open round."""
        j = self.ctx.jobs.get(job)
        if j is not None:
            self.waiting_next.get(job, {}).pop(node_id, None)
            j.round.remove(node_id)
            self.ctx.mark_job(job)
            self.expire_if_abandoned(j, node_id, time.monotonic() if now is None else now)

    def expire_if_abandoned(self, j: Job, gone: str, now: float) -> None:
        """A pending job (joined by workers, not submitted) that no live node waits for any more ends, instead of
        staying pending for ever; `gone` is the node that just left."""
        if j.state.terminal or j.spec is not None or j.round.frozen or j.round.joiners or self.waiting_next.get(j.name):
            return
        if any(n.job == j.name and not n.dead and n.node_id != gone for n in self.members.nodes.values()):
            return
        self.finish(j, JobState.CANCELLED, 1, "no live node waits in its rendezvous any more (the last one left or "
                    "died before it completed)", now)

    def rendezvous_progress(self, job: str) -> str:
        """A short description of an open rendezvous, for timeout messages."""
        j = self.ctx.jobs.get(job)
        if j is None:
            return "the job no longer exists"
        return (
            f"generation {j.generation}: {len(j.round.joiners)} node(s) joined, "
            f"nnodes {j.min_nodes}:{j.max_nodes}, state {j.state.name}"
        )

    def _maybe_freeze(self, j: Job, now: float) -> None:
        if j.state.terminal or not j.round.maybe_freeze(now):
            return
        j.state = JobState.RUNNING
        self.ctx.goodput.observe(j.name, j, now)
        if j.reason.startswith(REFUSED):
            j.reason = ""
        left = self.waiting_next.setdefault(j.name, {})
        for node_id, joiner in j.round.joiners.items():
            if j.round.member(node_id) is None:
                left[node_id] = (joiner.order_key, joiner.nproc)
        j.events.append(InfoEvent(f"generation {j.generation}: {len(j.round.members or [])} nodes, world size {j.round.world_size}"))
        self.ctx.notify("job", j.name)
        self.ctx.notify("events", j.name)

    @staticmethod
    def _assignment(j: Job, node_id: str) -> Assignment:
        m: Member | None = j.round.member(node_id)
        if m is None:
            raise FailedPrecondition(f"node {node_id} is not a member of generation {j.generation} of job {j.name!r}")
        return Assignment(
            j.generation, m.node_rank, len(j.round.members or []), m.rank_offset, j.round.world_size, m.nproc,
            j.round.secret, j.restarts_left,
        )

    def bump(self, j: Job, reason: str, count_restart: bool, exit_code: int, now: float, live: bool = False) -> bool:
        """Open the next generation (survivors re-join; `live`: their ranks keep running); fail the job when restarts
        run out."""
        if count_restart and j.restarts >= j.max_restarts:
            self.finish(
                j, JobState.FAILED, exit_code or 1, f"{reason}; no restarts left (max_restarts {j.max_restarts})", now
            )
            return False
        if count_restart:
            j.restarts += 1
        j.reason = reason
        j.past_rounds = [*j.past_rounds[-3:], j.round]
        j.round = self._new_round(j.generation + 1, j.min_nodes, j.max_nodes)
        carried = j.kv.carried()
        j.kv.release()
        j.kv = self.ctx.new_space()
        self.ctx.store_cleared(j.name)
        for name, value in carried:
            j.kv.restore(name, value)
            self.ctx.mark_kv(j.name, name)
        j.exits.clear()
        j.state = JobState.RESTARTING
        now_waiting = self.waiting_next.pop(j.name, {})
        for node_id, (key, nproc) in now_waiting.items():
            j.round.add(node_id, key, nproc, now)
        self.ctx.goodput.observe(j.name, j, now)
        verb = "re-forming live" if live else "restarting"
        j.events.append(InfoEvent(f"{verb} as generation {j.generation}: {reason}"))
        self.ctx.notify("job", j.name)
        self.ctx.notify("events", j.name)
        self.ctx.notify("timer")
        return True

    def finish(self, j: Job, state: JobState, exit_code: int, message: str, now: float) -> None:
        """End the job in `state`: its nodes are freed, a cancelled job's daemons told to stop it. The job keeps its
        generation (and round): a job cancelled while it gathered stays at the generation that never ran."""
        if state is not JobState.SUCCEEDED:
            j.kv.release()
            j.kv = self.ctx.new_space()
            self.ctx.store_cleared(j.name)
        j.state, j.exit_code, j.reason, j.finished_at = state, exit_code, message, now
        self.ctx.goodput.observe(j.name, j, now)
        self.waiting_next.pop(j.name, None)
        j.events.append(FinishedEvent(exit_code, message))
        for node in self.members.nodes.values():
            node.pids.pop(j.name, None)
            if node.job == j.name:
                node.job = ""
                self.members.mark(node)
        if state is JobState.CANCELLED:
            self.scheduler.cancel(j)
        self.ctx.notify("job", j.name)
        self.ctx.notify("events", j.name)
        self.scheduler.place()
