"""Live recovery through a link cut between nodes that all keep their leases (a partial partition).

Two nodes that cannot reach each other on the data plane, both still heartbeating, lose no lease: nothing dies, and
the collective between them stalls until the group's timeout. Every rank of the job then fails its collective (the
one that timed out tells the others), and each worker probes its peers' nodes; a worker that finds one it cannot
reach reports it (`ReportFailure` with `unreachable`) while its ranks keep running. The coordinator decides once,
from that report alone, so that both ends of a cut link reach the same decision whichever reports first:

* a reporter that cannot reach more than one node and more than half of the generation's other nodes is the one cut
  off: the job goes on without it;
* otherwise the job goes on without the node of the highest node rank among the reporter and the nodes it cannot
  reach: for one cut link, the end with the higher node rank (the other end keeps its processes).

The evicted node is told (the reply's `left_job`, and heartbeats no longer say `live` to it) and stops its ranks; the
next generation starts no earlier than a lease plus the fence (`fence_wait`) after the decision, by when that node's
ranks are dead whether it heard (it heartbeats) or lost its lease. A report about
a generation that already moved on (the other end's, once the decision was made) is answered with that decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from axond.coordinator.state.errors import InvalidArgument
from axond.coordinator.state.failures import JobFailures
from axond.coordinator.state.jobs import Job
from axond.coordinator.state.membership import Node
from axond.fencing import fence_wait


def evicted(nnodes: int, reporter: int, unreachable: Sequence[int]) -> int:
    """The node rank the job goes on without, given that node rank `reporter` of `nnodes` cannot reach the node
    ranks `unreachable` (the rule in this module's docstring)."""
    lost = set(unreachable)
    if len(lost) > 1 and 2 * len(lost) > nnodes - 1:
        return reporter
    return max(reporter, *unreachable)


class LinkCuts:
    """The coordinator's side of a cut link between live nodes: validate the report, decide, go on without one."""

    def __init__(self, failures: JobFailures) -> None:
        self.failures = failures

    def report(self, job: str, node_id: str, generation: int, unreachable: Sequence[int], message: str,
               now: float) -> tuple[int, bool]:
        """Node `node_id`'s ranks of `generation` cannot reach the nodes of node ranks `unreachable`; returns
        (generation, will_restart) as `report_failure` does (the servicer adds `left_job`)."""
        f = self.failures
        j = f.ctx.job(job)
        node, _ = f.members.touch(node_id, now)
        if not j.live:
            raise InvalidArgument(f"job {job!r} does not recover live: a report of unreachable nodes needs "
                                  "--live-recovery (a job without it restarts on its ranks' failure)")
        if not f._is_current(j, node_id, generation):  # decided already (the other end's report), or ended
            return j.generation, not j.state.terminal
        members = sorted(j.round.members or [], key=lambda m: m.node_rank)
        me = j.round.member(node_id)
        assert me is not None  # _is_current checked it
        wanted = sorted(set(unreachable))
        if not wanted or wanted[0] < 0 or wanted[-1] >= len(members) or me.node_rank in wanted:
            raise InvalidArgument(f"unreachable node ranks {list(unreachable)} must be other node ranks of generation "
                                  f"{generation} (0..{len(members) - 1}, not this node's {me.node_rank})")
        lost_rank = evicted(len(members), me.node_rank, wanted)
        lost = f.members.nodes[members[lost_rank].node_id]
        names = ", ".join(f"{members[r].node_id} ({f.members.nodes[members[r].node_id].hostname}, node rank {r})"
                          for r in wanted)
        detail = f": {message[:300]}" if message else ""
        reason = (f"node {node_id} ({node.hostname}, node rank {me.node_rank}) cannot reach {names} on the data plane"
                  f"{detail}; a link cut: going on without node {lost.node_id} ({lost.hostname}, node rank "
                  f"{lost_rank})")
        if not f._live_bump(j, lost, reason, now):
            will = f.lifecycle.bump(j, f"{reason}; too few nodes left to re-form live", True, 1, now)
            return j.generation, will
        self._fence(j, lost, now)
        return j.generation, True

    def _fence(self, j: Job, lost: Node, now: float) -> None:
        """The next generation starts no earlier than a lease and the fence after the decision: within the lease the
        evicted node's worker either heard it (its report's answer or a heartbeat) and stopped its ranks, or lost its
        lease and stopped them by that (`axond.fencing`); the fence covers the stopping itself."""
        f = self.failures
        interval = f.members.paced(lost)
        lease = interval * f.members.liveness.dead_after_missed
        j.round.not_before = max(j.round.not_before, now + lease + fence_wait(lease, interval, f.fence_margin))
