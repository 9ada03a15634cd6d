"""Read-only snapshots of nodes and jobs for GetStatus / `axond status` (bounded work per call)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from axond.coordinator.state.goodput import GoodputBook
from axond.coordinator.state.jobs import Job, JobState
from axond.coordinator.state.membership import Health, Membership

MAX_JOINED_HOSTS = 64
"""Hostnames of an open rendezvous listed per job."""


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
    hostname: str = ""
    pid: int = 0


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
    min_nodes: int = 0
    max_nodes: int = 0
    joined_hosts: tuple[str, ...] = ()
    ranks_omitted: int = 0
    finished_age_s: float = 0.0
    wall_s: float = 0.0
    """Seconds from the job's creation to its end (or now), kept by the coordinator's `GoodputBook`."""
    goodput: tuple[tuple[str, float], ...] = ()
    """(cause, seconds) of that wall time, productive first (`coordinator.state.goodput.CAUSES`)."""


@dataclass(frozen=True)
class StatusSnapshot:
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]


def _ranks(members: Membership, job: Job, limit: int) -> tuple[RankView, ...]:
    """The job's first `limit` ranks: work proportional to what is listed, not to the world size."""
    out: list[RankView] = []
    for m in job.round.members or []:
        if len(out) >= limit:
            break
        node = members.nodes.get(m.node_id)
        # Only the pids of this job's running generation: a finished job's ranks have none, and a node's other
        # jobs (or later generations) have their own.
        gen, pids = node.pids.get(job.name, (0, ())) if node is not None else (0, ())
        if job.state.terminal or gen != job.generation:
            pids = ()
        for i in range(min(m.nproc, limit - len(out))):
            out.append(RankView(m.rank_offset + i, m.node_id, i, m.node_rank, m.hostname, pids[i] if i < len(pids) else 0))
    return tuple(out)


def snapshot(
    members: Membership, jobs: Iterable[Job], now: float, max_ranks: int = 1024, node_retention_s: float | None = None,
    goodput: GoodputBook | None = None,
) -> StatusSnapshot:
    """Copy what `axond status` shows; nodes in rank order (hostname, registration).

    Nodes dead for longer than `node_retention_s` are left out (None: every node).
    """
    nodes = tuple(
        NodeView(n.node_id, n.hostname, members.health(n, now), max(0.0, now - n.last_seen), n.slots, n.daemon, n.job)
        for n in sorted(members.nodes.values(), key=lambda n: n.order_key)
        if node_retention_s is None or not n.dead or now - n.last_seen <= node_retention_s
    )
    views = []
    for j in jobs:
        clock = goodput.read(j.name, j, now) if goodput is not None else None
        ranks = _ranks(members, j, max_ranks)
        frozen = j.round.members is not None
        nnodes = len(j.round.members or []) if frozen else len(j.round.joiners)
        hosts = () if frozen else tuple(x.hostname for x in islice(j.round.joiners.values(), MAX_JOINED_HOSTS))
        views.append(
            JobView(
                j.name, j.state, j.generation, j.round.world_size, nnodes, j.restarts, j.max_restarts, j.reason, ranks,
                j.min_nodes, j.max_nodes, hosts, j.round.world_size - len(ranks),
                0.0 if j.finished_at is None else max(0.0, now - j.finished_at),
                clock.wall(now) if clock is not None else 0.0,
                tuple(clock.totals(now).items()) if clock is not None else (),
            )
        )
    return StatusSnapshot(nodes, tuple(views))
