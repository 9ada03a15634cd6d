"""What ends a generation from the outside: a node lost (dead or deregistered), a rank or agent that failed, a node's
ranks that exited; and live recovery, which goes on with the survivors instead of restarting everyone.

Plain and non-blocking; the caller (`CoordinatorState`) holds the lock. The generations themselves (the next one
opened, or the job ended) are `JobLifecycle`'s (lifecycle.py); this component decides which, and when a later
generation may start after a death (`axond.fencing`).
"""

from __future__ import annotations

from axond.coordinator.state.context import StateContext
from axond.coordinator.state.errors import FailedPrecondition, InvalidArgument
from axond.coordinator.state.jobs import MAX_LEFT, Job, JobState
from axond.coordinator.state.lifecycle import JobLifecycle
from axond.coordinator.state.membership import Membership, Node
from axond.coordinator.state.scheduling import Scheduler
from axond.fencing import FENCE_MARGIN_S, fence_wait


class JobFailures:
    """Lost nodes, failure and exit reports, and live recovery's re-formation with the survivors."""

    def __init__(self, members: Membership, lifecycle: JobLifecycle, scheduler: Scheduler, ctx: StateContext,
                 fence_margin: float = FENCE_MARGIN_S) -> None:
        self.members = members
        self.lifecycle = lifecycle
        self.scheduler = scheduler
        self.ctx = ctx
        self.fence_margin = fence_margin
        """Seconds (beyond what a short lease adds, `fence_wait`) between declaring a node dead and starting a later
        generation of its job: its worker has killed its ranks by then."""

    def node_lost(self, node: Node, why: str, now: float, dead: bool = False) -> None:
        """The node died (`dead`: its lease ran out) or left: drop it from open rounds and restart the jobs it ran; a
        restarting job left with no node to restart it fails, saying so. After a death, the job's next generation
        starts no earlier than `fence_wait` later (the dead node's worker may still be killing its ranks)."""
        lifecycle = self.lifecycle
        for job in list(self.ctx.jobs.values()):
            ran = node.job == job.name
            lifecycle.waiting_next.get(job.name, {}).pop(node.node_id, None)
            if job.state.terminal:
                continue
            if job.round.remove(node.node_id):
                self.ctx.notify("job", job.name)
                ran = True
                lifecycle.expire_if_abandoned(job, node.node_id, now)
                if job.state.terminal:
                    continue
            lost_assigned = node.node_id in job.assigned and job.round.member(node.node_id) is None
            if job.active_member(node.node_id) or lost_assigned:
                ran = True
                if node.node_id in job.assigned:
                    job.assigned.remove(node.node_id)
                    self.scheduler.enqueue(job.name)
                self.ctx.goodput.detected(job.name, node.last_seen, now)
                reason = f"node {node.node_id} ({node.hostname}) {why}"
                if not self._live_bump(job, node, reason, now):
                    lifecycle.bump(job, reason, True, 1, now)
                if dead and not job.state.terminal:
                    interval = self.members.paced(node)
                    lease = interval * self.members.liveness.dead_after_missed
                    wait = fence_wait(lease, interval, self.fence_margin)
                    job.round.not_before = max(job.round.not_before, now + wait)
            if ran and self._orphaned(job, node):
                lifecycle.finish(job, JobState.FAILED, 1, (
                    f"generation {job.generation} has no node left to run it (the last, {node.node_id} "
                    f"({node.hostname}), {why}); start its workers again to rerun it"), now)
        self.scheduler.place()

    def _orphaned(self, j: Job, lost: Node) -> bool:
        """Whether `j` (started by `axond worker`s, not submitted) waits for a generation no live node will join:
        restarting, with nobody in its round or waiting for it and no live node still running it."""
        if (j.spec is not None or j.state is not JobState.RESTARTING or j.round.joiners
                or self.lifecycle.waiting_next.get(j.name)):
            return False
        return not any(n.job == j.name and not n.dead and n is not lost for n in self.members.nodes.values())

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
        j = self.ctx.job(job)
        node, _ = self.members.touch(node_id, now)
        if not self._is_current(j, node_id, generation):
            return j.generation, not j.state.terminal
        if not -1 <= rank < j.round.world_size:
            raise InvalidArgument(f"rank {rank} is outside 0..{j.round.world_size - 1} (or -1 for the agent)")
        who = f"rank {rank}" if rank >= 0 else "the agent"
        detail = f": {message[:500]}" if message else ""
        reason = f"{who} on node {node_id} ({node.hostname}) failed with exit code {exit_code}{detail}"
        if self._live_bump(j, node, reason, now, rejoins=j.restarts_left > 0):
            return j.generation, True
        will = self.lifecycle.bump(j, reason, True, exit_code, now)
        return j.generation, will

    def left_job(self, job: str, node_id: str) -> bool:
        """Whether live recovery went on without `node_id` (its worker leaves the job instead of re-joining)."""
        j = self.ctx.jobs.get(job)
        return j is not None and j.live and node_id in j.left

    def _live_bump(self, j: Job, lost: Node, reason: str, now: float, rejoins: bool = False) -> bool:
        """Live recovery: open the next generation with the other members of this one (their ranks keep running, they
        re-join at once, no restart is counted), without `lost`; False (restart as usual) when fewer than
        `min_nodes` would be left, or the job is not live. `rejoins`: `lost`'s worker reported its rank's failure and
        re-joins as a replacement (restarts are left): the generation waits for it too (at most `--settle-time`), so
        that its new rank joins this re-formation (and offers the lost rank's shards from that worker's memory)."""
        members = j.round.members
        if not j.live or members is None or j.round.member(lost.node_id) is None:
            return False
        survivors = [m.node_id for m in members if m.node_id != lost.node_id and m.node_id not in j.exits
                     and not getattr(self.members.nodes.get(m.node_id), "dead", True)]
        if len(survivors) < j.min_nodes:
            return False
        self.lifecycle.bump(j, f"{reason}; re-forming live with the {len(survivors)} other node(s)", False, 0, now,
                            live=True)
        j.round.expected = frozenset([*survivors, lost.node_id] if rejoins else survivors)
        j.live_generation = j.generation
        j.left = [*j.left[-(MAX_LEFT - 1):], lost.node_id]
        self.ctx.mark_job(j.name)
        if lost.job == j.name:
            lost.job = ""
            self.members.mark(lost)
        return True

    def report_exit(self, job: str, node_id: str, generation: int, exit_code: int, now: float) -> None:
        """The node's local ranks of `generation` all exited; the job ends when every node did."""
        j = self.ctx.job(job)
        node, _ = self.members.touch(node_id, now)
        if not self._is_current(j, node_id, generation):
            return
        j.exits[node_id] = exit_code
        node.job = ""
        self.members.mark(node)
        self.ctx.mark_job(job)
        if exit_code != 0:
            self.lifecycle.finish(
                j, JobState.FAILED, exit_code, f"node {node_id} ({node.hostname}) exited with code {exit_code}", now
            )
        elif len(j.exits) == len(j.round.members or []):
            self.lifecycle.finish(j, JobState.SUCCEEDED, 0, "every rank exited 0", now)
