"""The submitted-jobs half of CoordinatorState: `axond run` jobs, daemon work, output and cancel."""

from __future__ import annotations

import threading
from collections.abc import Hashable

from axond.coordinator.errors import AlreadyExists, FailedPrecondition, InvalidArgument, check_name, check_positive
from axond.coordinator.jobs import CANCELLED_EXIT_CODE, Event, Job, JobSpec, JobState, OutputEvent
from axond.coordinator.membership import Membership
from axond.coordinator.rendezvous import Round
from axond.coordinator.scheduling import Scheduler

MAX_LINES_PER_PUSH = 10_000
MAX_LINE_CHARS = 64 * 1024


class SubmittedJobs:
    """Job submission and the daemon side; mixed into CoordinatorState."""

    lock: threading.RLock
    jobs: dict[str, Job]
    members: Membership
    scheduler: Scheduler
    _job_seq: int

    def _job(self, name: str) -> Job:
        raise NotImplementedError

    def _notify(self, *topic: Hashable) -> None:
        raise NotImplementedError

    def _new_round(self, generation: int, min_nodes: int, max_nodes: int) -> Round:
        raise NotImplementedError

    def _finish(self, j: Job, state: JobState, exit_code: int, message: str) -> None:
        raise NotImplementedError

    def submit_job(self, name: str, spec: JobSpec, now: float) -> str:
        """Queue a job for placement on worker daemons; returns its name (generated if empty)."""
        with self.lock:
            check_positive("nnodes", spec.nnodes)
            check_positive("nproc_per_node", spec.nproc_per_node)
            if not spec.argv or not spec.argv[0]:
                raise InvalidArgument("the job needs a command: axond run ... -- CMD ARGS")
            if spec.max_restarts < 0:
                raise InvalidArgument(f"max_restarts is {spec.max_restarts}; it must be >= 0")
            if not name:
                self._job_seq += 1
                while f"job-{self._job_seq}" in self.jobs:
                    self._job_seq += 1
                name = f"job-{self._job_seq}"
            check_name("job", name)
            old = self.jobs.get(name)
            if old is not None and not old.state.terminal:
                raise AlreadyExists(f"job {name!r} is still {old.state.name}; pick another name or cancel it")
            generation = old.generation + 1 if old is not None else 1
            rnd = self._new_round(generation, spec.nnodes, spec.nnodes)
            self.jobs[name] = Job(name, spec.nnodes, spec.nnodes, spec.max_restarts, rnd, spec=spec)
            self.scheduler.enqueue(name)
            self._place()
            return name

    def _place(self) -> None:
        woken, noted = self.scheduler.place(self.members, self.jobs)
        for node_id in woken:
            self._notify("work", node_id)
        for name in noted:
            self._notify("events", name)

    def take_work(self, node_id: str, now: float) -> tuple[list[tuple[str, JobSpec]], list[str]]:
        """Assignments and cancellations for a daemon, each delivered once."""
        with self.lock:
            node, _ = self.members.touch(node_id, now)
            if not node.daemon:
                raise FailedPrecondition(
                    f"node {node_id} did not register as a daemon (slots >= 1); it cannot take work"
                )
            self._place()
            names, cancelled = self.scheduler.take(node_id)
            work = []
            for name in names:
                job = self.jobs.get(name)
                if job is not None and job.spec is not None and not job.state.terminal:
                    work.append((name, job.spec))
            return work, cancelled

    def push_output(self, job: str, node_id: str, lines: list[tuple[int, str, str]]) -> None:
        """Append rank output lines to the job's event log."""
        with self.lock:
            j = self._job(job)
            self.members.get(node_id)
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
            self._notify("events", job)

    def read_events(self, job: str, index: int) -> tuple[list[Event], int, int, bool]:
        """Events from `index`: (events, next index, dropped count, whether the job finished)."""
        with self.lock:
            j = self._job(job)
            events, nxt, skipped = j.events.read(index)
            return events, nxt, skipped, j.state.terminal

    def cancel_job(self, job: str, now: float) -> None:
        """Cancel a job (idempotent): agents learn it on their next heartbeat, daemons on PollWork."""
        with self.lock:
            j = self._job(job)
            if not j.state.terminal:
                self._finish(j, JobState.CANCELLED, CANCELLED_EXIT_CODE, "cancelled")
