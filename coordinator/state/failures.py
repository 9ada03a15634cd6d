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
            awaited = self._awaited_live(job, node)
            if job.active_member(node.node_id) or lost_assigned or awaited:
                ran = True
                if node.node_id in job.assigned:
                    job.assigned.remove(node.node_id)
                    self.scheduler.enqueue(job.name)
                self.ctx.goodput.detected(job.name, node.last_seen, now)
                reason = f"node {node.node_id} ({node.hostname}) {why}"
                ran_ranks = not awaited or self._ran_before(job, node)
                if awaited:  # it was to join the forming generation (its ranks running): it goes on without it
                    if not self._drop_expected(job, node, reason, ran_ranks):
                        lifecycle.bump(job, f"{reason}; too few nodes left to re-form live", True, 1, now)
                elif not self._live_bump(job, node, reason, now):
                    lifecycle.bump(job, reason, True, 1, now)
                if dead and ran_ranks and not job.state.terminal:
                    interval = self.members.paced(node)
                    lease = interval * self.members.liveness.dead_after_missed
                    wait = fence_wait(lease, interval, self.fence_margin)
                    job.round.not_before = max(job.round.not_before, now + wait)
            if ran and self._orphaned(job, node):
                lifecycle.finish(job, JobState.FAILED, 1, (
                    f"generation {job.generation} has no node left to run it (the last, {node.node_id} "
                    f"({node.hostname}), {why}); start its workers again to rerun it"), now)
        self.scheduler.place()

    @staticmethod
    def _awaited_live(j: Job, node: Node) -> bool:
        """Whether the open round of live job `j` awaits `node` to bring its running ranks (not joined yet)."""
        rnd = j.round
        return (j.live and j.live_generation == j.generation and not rnd.frozen and node.node_id in rnd.expected
                and node.node_id not in rnd.joiners)

    @staticmethod
    def _ran_before(j: Job, node: Node) -> bool:
        """Whether `node` ran ranks in the generation before the current one of `j`."""
        return bool(j.past_rounds) and j.past_rounds[-1].member(node.node_id) is not None

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
        who = f"rank {rank}" if rank >= 0 else "the agent"
        detail = f": {message[:500]}" if message else ""
        reason = f"{who} on node {node_id} ({node.hostname}) failed with exit code {exit_code}{detail}"
        if not self._is_current(j, node_id, generation):
            late = self._late_live_failure(j, node, generation, reason, exit_code, now)
            return j.generation, (not j.state.terminal) if late is None else late
        if not -1 <= rank < j.round.world_size:
            raise InvalidArgument(f"rank {rank} is outside 0..{j.round.world_size - 1} (or -1 for the agent)")
        if self._live_bump(j, node, reason, now, rejoins=j.restarts_left > 0):
            return j.generation, True
        will = self.lifecycle.bump(j, reason, True, exit_code, now)
        return j.generation, will

    def _late_live_failure(self, j: Job, node: Node, generation: int, reason: str, exit_code: int,
                           now: float) -> bool | None:
        """A failure of `node`'s ranks of an earlier `generation` of live job `j`, reported after live recovery opened
        the current one (the node's ranks and another node's failed at about the same time). The current generation
        counts on the nodes it expects to bring their running ranks: this one has none left, so it must not join it
        with fresh ones as if restarted (they would meet the survivors mid-recovery, and no restart would be counted).
        Like a failure in the current generation: with restarts left its worker re-joins as a replacement, awaited by
        the generation (as `_live_bump`'s `rejoins`); else the job goes on without the node (`left_job`), or, with
        fewer than `min_nodes` left, restarts as usual.
        Returns will_restart, or None when this is not such a report (answered as any stale report)."""
        rnd = j.round
        if (not j.live or j.state.terminal or generation >= j.generation or j.live_generation != j.generation
                or rnd.member(node.node_id) is not None or node.node_id in rnd.joiners):
            return None
        if node.node_id in j.left:
            return True
        replacing = len(rnd.expected & set(j.left))  # awaited workers re-joining as replacements, each to be counted
        if j.restarts_left > replacing and node.node_id in rnd.expected:  # this one re-joins too: still awaited
            j.reason = f"{j.reason}; then {reason}; awaiting its worker's replacement ranks"
            self._left(j, node)  # (its re-join counted when it joins), as after `_live_bump`
            return True
        if not self._drop_expected(j, node, reason, True):
            return self.lifecycle.bump(j, f"{reason}; too few nodes left to re-form live", True, exit_code, now)
        return True

    def _drop_expected(self, j: Job, lost: Node, reason: str, ran: bool) -> bool:
        """Live job `j`'s current generation goes on without `lost` (not one of its members or joiners): it is no
        longer awaited and, if it `ran` ranks of the job, is remembered as left. False (nothing changed) when fewer
        than `min_nodes` would be left of the nodes the open round awaits."""
        rnd = j.round
        if not rnd.frozen and lost.node_id in rnd.expected:
            rest = rnd.expected - {lost.node_id}
            if len(rest) < j.min_nodes:
                return False
            rnd.expected = rest
            j.reason = f"{j.reason}; then {reason}; re-forming live without it"
            self.ctx.notify("timer")  # the round may freeze now: every node it still awaits joined
        self._left(j, lost, ran)  # a newcomer that never ran is just no longer awaited
        return True

    def _left(self, j: Job, node: Node, ran: bool = True) -> None:
        """`node` is out of live job `j`'s generation: remembered as left (once) if it `ran` ranks of the job, so that
        its worker re-joins only as a replacement, counted (`charge_rejoin`)."""
        if ran and node.node_id not in j.left:
            j.left = [*j.left[-(MAX_LEFT - 1):], node.node_id]
        self.ctx.mark_job(j.name)
        self.ctx.notify("job", j.name)
        if node.job == j.name:
            node.job = ""
            self.members.mark(node)

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
        self._left(j, lost)
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
