"""Live recovery's growth: a node that joins a running live job below its MAX is admitted at once, beside the running
ranks, in a new generation (no restart of the running ones, no restart counted).

Plain and non-blocking; the caller (`JobLifecycle.join`, under the state's lock) has already put the newcomer among the
nodes waiting for the job's next generation. The running nodes hear of that generation on their next heartbeat (it is
marked live: they keep their ranks, tell them, and re-join, exactly as after a failed node); the round freezes as soon
as they and the newcomer joined. The newcomer's ranks take their state from a live peer (`axond.train.join`).
A new node counts no restart; a node that live recovery went on without (its rank failed) and that joins again counts
one, and is refused once none is left.
"""

from __future__ import annotations

from typing import Protocol

from axond.coordinator.state.errors import FailedPrecondition
from axond.coordinator.state.jobs import Job
from axond.coordinator.state.membership import Membership, Node

class Bump(Protocol):
    """`JobLifecycle.bump`."""

    def __call__(self, j: Job, reason: str, count_restart: bool, exit_code: int, now: float,
                 live: bool = False) -> bool: ...


def running_nodes(j: Job, members: Membership) -> list[str]:
    """The members of the job's frozen generation whose ranks still run (not exited, not declared dead)."""
    return [m.node_id for m in j.round.members or []
            if m.node_id not in j.exits and not getattr(members.nodes.get(m.node_id), "dead", True)]


def grow_live(j: Job, node: Node, members: Membership, bump: Bump, now: float, rejoins: bool = False) -> None:
    """Open the next generation of live job `j` with its running nodes plus `node` (which waits for it already;
    `rejoins`: live recovery went on without it before)."""
    if j.exits:
        raise FailedPrecondition(
            f"job {j.name!r} is finishing (node(s) {', '.join(sorted(j.exits))} exited), so node {node.node_id} cannot "
            "join it live; start this worker again under another --job name"
        )
    running = running_nodes(j, members)
    was = " again after its rank failed (one restart counted)" if rejoins else ""
    bump(j, f"node {node.node_id} ({node.hostname}) joined{was}; re-forming live with {len(running) + 1} node(s), "
         "the running ranks keep their processes", False, 0, now, live=True)
    j.round.expected = frozenset([*running, node.node_id])
    j.live_generation = j.generation


def charge_rejoin(j: Job, node: Node) -> None:
    """A node live recovery went on without joins the job again (its worker restarts the failed rank): count one
    restart, or refuse it when none is left (the job goes on without it)."""
    if j.restarts >= j.max_restarts:
        raise FailedPrecondition(
            f"node {node.node_id} left job {j.name!r} when its rank failed, and re-joining it would restart that rank: "
            f"no restarts left (max_restarts {j.max_restarts}); the job goes on without it"
        )
    j.restarts += 1
