"""Submitted jobs (`axond run`): the queue for worker daemons, their work, the jobs' output and cancel."""

from __future__ import annotations

from axond.coordinator.state.context import StateContext
from axond.coordinator.state.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    check_at_most,
    check_name,
    check_positive,
    short,
)
from axond.coordinator.state.jobs import CANCELLED_EXIT_CODE, Event, JobSpec, JobState, OutputEvent
from axond.coordinator.state.lifecycle import JobLifecycle
from axond.coordinator.state.membership import Membership
from axond.coordinator.state.scheduling import Scheduler

MAX_LINES_PER_PUSH = 10_000
MAX_LINE_CHARS = 64 * 1024


class SubmittedJobs:
    """Job submission and the daemon side (plain; the caller holds the lock)."""

    def __init__(self, members: Membership, lifecycle: JobLifecycle, scheduler: Scheduler, ctx: StateContext) -> None:
        self.members = members
        self.lifecycle = lifecycle
        self.scheduler = scheduler
        self.ctx = ctx
        self.job_seq = 0
        """The number in the last generated job name (job-N)."""

    def _check_spec(self, spec: JobSpec) -> None:
        limits = self.ctx.limits
        check_positive("nnodes", spec.nnodes)
        check_positive("nproc_per_node", spec.nproc_per_node)
        if spec.min_nodes > spec.nnodes:
            raise InvalidArgument(f"min_nodes is {spec.min_nodes}, above nnodes {spec.nnodes}; it must be at most that")
        if spec.min_nodes not in (0, spec.nnodes) and not spec.live_recovery:
            raise InvalidArgument(
                f"nnodes {spec.min_nodes}:{spec.nnodes} for a submitted job needs live_recovery (axond run "
                "--live-recovery); submitted jobs restart at their full size otherwise"
            )
        check_at_most("nnodes", spec.nnodes, limits.max_nnodes, "max_nnodes")
        check_at_most("nproc_per_node", spec.nproc_per_node, limits.max_nproc_per_node, "max_nproc_per_node")
        check_at_most("world size", spec.nnodes * spec.nproc_per_node, limits.max_world_size, "max_world_size")
        if not spec.argv or not spec.argv[0]:
            raise InvalidArgument("the job needs a command: axond run ... -- CMD ARGS")
        if spec.max_restarts < 0:
            raise InvalidArgument(f"max_restarts is {spec.max_restarts}; it must be >= 0")
        size = sum(len(a) + 1 for a in spec.argv) + sum(len(k) + len(v) + 2 for k, v in spec.env) + len(spec.cwd)
        check_at_most("the command's size in characters (argv, env and cwd)", size, limits.max_command_bytes,
                      "max_command_bytes")

    def submit_job(self, name: str, spec: JobSpec, now: float) -> str:
        """Queue a job for placement on worker daemons; returns its name (generated if empty)."""
        self._check_spec(spec)
        if len(self.scheduler.queue) >= self.ctx.limits.max_queued_jobs:
            raise ResourceExhausted(
                f"{len(self.scheduler.queue)} submitted jobs already wait for worker daemons (max_queued_jobs); "
                "start more `axond worker --slots K` daemons or cancel queued jobs"
            )
        if not name:
            self.job_seq += 1
            while f"job-{self.job_seq}" in self.ctx.jobs:
                self.job_seq += 1
            name = f"job-{self.job_seq}"
        check_name("job", name, self.ctx.limits.max_name_chars)
        old = self.ctx.jobs.get(name)
        if old is not None and not old.state.terminal:
            raise AlreadyExists(f"job {short(name)} is still {old.state.name}; pick another name or cancel it")
        j = self.lifecycle.new_job(name, spec.least_nodes, spec.nnodes, spec.max_restarts, live=spec.live_recovery)
        j.spec = spec
        self.ctx.goodput.observe(name, j, now)  # queued for daemons: waiting for members
        self.scheduler.enqueue(name)
        self.scheduler.place()
        return name

    def take_work(self, node_id: str, now: float) -> tuple[list[tuple[str, JobSpec]], list[str]]:
        """Assignments and cancellations for a daemon, each delivered once."""
        node, _ = self.members.touch(node_id, now)
        if not node.daemon:
            raise FailedPrecondition(f"node {node_id} did not register as a daemon (slots >= 1); it cannot take work")
        self.scheduler.place()
        names, cancelled = self.scheduler.take(node_id)
        self.ctx.mark_meta()
        work = []
        for name in names:
            job = self.ctx.jobs.get(name)
            if job is not None and job.spec is not None and not job.state.terminal:
                work.append((name, job.spec))
        return work, cancelled

    def push_output(self, job: str, node_id: str, lines: list[tuple[int, str, str]]) -> None:
        """Append rank output lines to the job's event log; only the job's own nodes may."""
        j = self.ctx.job(job)
        self.members.get(node_id)
        if node_id not in j.assigned and j.round.member(node_id) is None:
            raise PermissionDenied(f"node {short(node_id)} does not run job {short(job)}; it cannot push its output")
        if len(lines) > MAX_LINES_PER_PUSH:
            raise InvalidArgument(f"{len(lines)} output lines in one call; send at most {MAX_LINES_PER_PUSH}")
        for rank, stream, text in lines:
            if rank < -1:
                raise InvalidArgument(f"output line rank {rank}; it must be >= 0 (or -1 for the agent)")
            if stream not in ("stdout", "stderr"):
                raise InvalidArgument(f"output stream {stream!r}; it must be 'stdout' or 'stderr'")
            if len(text) > MAX_LINE_CHARS:
                raise InvalidArgument(f"an output line of {len(text)} characters; split it (limit {MAX_LINE_CHARS})")
        for rank, stream, text in lines:
            j.events.append(OutputEvent(rank, stream, text))
        self.ctx.notify("events", job)

    def read_events(self, job: str, index: int) -> tuple[list[Event], int, int, bool]:
        """Events from `index`: (events, next index, dropped count, whether the job finished)."""
        j = self.ctx.job(job)
        events, nxt, skipped = j.events.read(index)
        return events, nxt, skipped, j.state.terminal

    def cancel_job(self, job: str, now: float) -> None:
        """Cancel a job (idempotent): agents learn it on their next heartbeat, daemons on PollWork."""
        j = self.ctx.job(job)
        if not j.state.terminal:
            self.lifecycle.finish(j, JobState.CANCELLED, CANCELLED_EXIT_CODE, "cancelled", now)
