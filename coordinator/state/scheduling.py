"""Placement of submitted jobs on worker daemons (plain; the caller holds the state's lock).

A queued job is placed on the first `nnodes` alive daemons, ordered by (hostname, registration
order), that have `nproc_per_node` free slots; placement is all-or-nothing for a new job, and
fills the missing nodes of a job that lost a daemon. Assignments and cancellations are delivered
once, on the daemon's next PollWork.
"""

from __future__ import annotations

from axond.coordinator.state.context import StateContext
from axond.coordinator.state.jobs import InfoEvent, Job
from axond.coordinator.state.membership import Membership, Node


class Scheduler:
    """The queue of submitted jobs awaiting daemons, and per-daemon deliveries."""

    def __init__(self, members: Membership, ctx: StateContext) -> None:
        self.members = members
        self.ctx = ctx
        self.queue: list[str] = []
        self.deliveries: dict[str, list[str]] = {}
        self.cancels: dict[str, list[str]] = {}

    def enqueue(self, name: str) -> None:
        if name not in self.queue:
            self.queue.append(name)

    def free_slots(self) -> dict[str, int]:
        free = {n.node_id: n.slots for n in self.members.nodes.values() if n.daemon and not n.dead}
        for job in self.ctx.jobs.values():
            if job.spec is None or job.state.terminal:
                continue
            for node_id in job.assigned:
                if node_id in free:
                    free[node_id] -= job.spec.nproc_per_node
        return free

    def place(self) -> None:
        """Place what fits, waking the daemons with a new delivery and the readers of jobs with a new notice."""
        for name in self.queue:
            self.ctx.mark_job(name)
        self.ctx.mark_meta()
        woken, noted = self._place()
        for node_id in woken:
            self.ctx.notify("work", node_id)
        for name in noted:
            self.ctx.notify("events", name)

    def _place(self) -> tuple[list[str], list[str]]:
        """Place what fits; returns (node ids with a new delivery, jobs with a new notice)."""
        members, jobs = self.members, self.ctx.jobs
        woken: list[str] = []
        noted: list[str] = []
        for name in list(self.queue):
            job = jobs.get(name)
            if job is None or job.spec is None or job.state.terminal:
                self.queue.remove(name)
                continue
            spec = job.spec
            need = spec.nnodes - len(job.assigned)
            if need <= 0:
                self.queue.remove(name)
                continue
            free = self.free_slots()
            candidates: list[Node] = sorted(
                (members.nodes[i] for i, f in free.items() if f >= spec.nproc_per_node and i not in job.assigned),
                key=lambda n: n.order_key,
            )
            if not candidates or (len(candidates) < need and not job.assigned):
                self._note(
                    job, noted,
                    f"waiting for {need} worker daemon(s) with >= {spec.nproc_per_node} free slots; "
                    f"{len(candidates)} available (start more `axond worker --slots K` daemons)",
                )
                continue
            chosen = candidates[:need]
            for node in chosen:
                job.assigned.append(node.node_id)
                self.deliveries.setdefault(node.node_id, []).append(name)
                woken.append(node.node_id)
            self._note(job, noted, "placed on " + ", ".join(f"{n.hostname} ({n.node_id})" for n in chosen))
            if len(job.assigned) >= spec.nnodes:
                self.queue.remove(name)
        return woken, noted

    def cancel(self, job: Job) -> None:
        """Tell the job's daemons to stop it (on their next PollWork)."""
        for node_id in job.assigned:
            self.cancels.setdefault(node_id, []).append(job.name)
            pending = self.deliveries.get(node_id, [])
            if job.name in pending:
                pending.remove(job.name)
            self.ctx.notify("work", node_id)

    def take(self, node_id: str) -> tuple[list[str], list[str]]:
        """Pop the job names newly assigned to and cancelled on `node_id`."""
        return self.deliveries.pop(node_id, []), self.cancels.pop(node_id, [])

    def forget_node(self, node_id: str) -> None:
        self.deliveries.pop(node_id, None)
        self.cancels.pop(node_id, None)

    @staticmethod
    def _note(job: Job, noted: list[str], text: str) -> None:
        if text != job.placement_note:
            job.placement_note = text
            job.events.append(InfoEvent(text))
            noted.append(job.name)
