"""Read-only snapshots of nodes and jobs for GetStatus / `axond status`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from axond.coordinator.jobs import Job, JobState
from axond.coordinator.membership import Health, Membership


@dataclass(frozen=True)
class NodeView:
    node_id: str
    hostname: str
    health: Health
    last_heartbeat_age_s: float
    slots: int
    daemon: bool
    job: str


@dataclass(frozen=True)
class RankView:
    rank: int
    node_id: str
    local_rank: int
    node_rank: int


@dataclass(frozen=True)
class JobView:
    job: str
    state: JobState
    generation: int
    world_size: int
    nnodes: int
    restarts: int
    max_restarts: int
    reason: str
    ranks: tuple[RankView, ...]


@dataclass(frozen=True)
class StatusSnapshot:
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]


def snapshot(members: Membership, jobs: Iterable[Job], now: float) -> StatusSnapshot:
    """Copy what `axond status` shows; nodes in rank order (hostname, registration)."""
    nodes = tuple(
        NodeView(n.node_id, n.hostname, members.health(n, now), max(0.0, now - n.last_seen), n.slots, n.daemon, n.job)
        for n in sorted(members.nodes.values(), key=lambda n: n.order_key)
    )
    views = []
    for j in jobs:
        ranks = tuple(
            RankView(m.rank_offset + i, m.node_id, i, m.node_rank)
            for m in j.round.members or []
            for i in range(m.nproc)
        )
        nnodes = len(j.round.members) if j.round.members is not None else len(j.round.joiners)
        views.append(
            JobView(j.name, j.state, j.generation, j.round.world_size, nnodes, j.restarts, j.max_restarts, j.reason, ranks)
        )
    return StatusSnapshot(nodes, tuple(views))
