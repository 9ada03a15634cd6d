"""The coordinator's /metrics: nodes, jobs and their states, rendezvous and restarts, heartbeat lag, KV ops.

Read from the coordinator's state on its own event loop (where the state changes), so a scrape sees one
consistent snapshot; bounded work: one status snapshot without ranks.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from axond.coordinator.state.jobs import JobState
from axond.coordinator.state.membership import Health
from axond.observe.exposition import Family, render
from axond.observe.goodput_metrics import goodput_families

if TYPE_CHECKING:
    from axond.coordinator.server import RunningCoordinator

SCRAPE_TIMEOUT_S = 5.0
"""How long a scrape waits for the coordinator's event loop to take the snapshot."""

KV_OPS = ("set", "get", "add", "compare_set", "delete", "wait", "barrier")
"""The KV store calls counted by `axond_kv_ops_total` (unary and streamed alike)."""


def _snapshot(running: RunningCoordinator) -> tuple[Any, dict[str, int]]:
    state = running.state
    snap = state.status("", time.monotonic(), all=True, max_ranks=1)
    return snap, dict(getattr(state, "kv_ops", {}))


async def _on_loop(running: RunningCoordinator) -> tuple[Any, dict[str, int]]:
    return _snapshot(running)


def coordinator_families(running: RunningCoordinator) -> list[Family]:
    """The coordinator's metric families, now."""
    loop = running._loop
    if loop is not None and loop.is_running():
        snap, kv_ops = asyncio.run_coroutine_threadsafe(_on_loop(running), loop).result(SCRAPE_TIMEOUT_S)
    else:
        snap, kv_ops = _snapshot(running)

    nodes = Family("axond_nodes", "gauge", "Registered nodes by health (alive, suspect, dead).")
    by_health = Counter(n.health.name.lower() for n in snap.nodes)
    for h in Health:
        nodes.add(by_health.get(h.name.lower(), 0), health=h.name.lower())
    age = Family("axond_node_heartbeat_age_seconds", "gauge",
                 "Seconds since each node's last heartbeat (heartbeat lag).")
    for n in snap.nodes:
        age.add(n.last_heartbeat_age_s, node=n.node_id, hostname=n.hostname)
    worst = Family("axond_heartbeat_age_max_seconds", "gauge",
                   "The largest heartbeat lag of a node not declared dead.")
    live = [n.last_heartbeat_age_s for n in snap.nodes if n.health is not Health.DEAD]
    worst.add(max(live, default=0.0))

    jobs = Family("axond_jobs", "gauge", "Jobs by state.")
    by_state = Counter(j.state.name.lower() for j in snap.jobs)
    for s in JobState:
        jobs.add(by_state.get(s.name.lower(), 0), state=s.name.lower())
    job_state = Family("axond_job_state", "gauge", "1 for each job's current state (pending, running, ...).")
    generation = Family("axond_job_generation", "gauge", "The job's current generation (1 + its restarts).")
    world = Family("axond_job_world_size", "gauge", "Ranks of the job's current generation (0 while it gathers).")
    job_nodes = Family("axond_job_nodes", "gauge", "Nodes in the job's current generation (or joined so far).")
    rendezvous = Family("axond_job_rendezvous_total", "counter", "Rendezvous rounds of the job that completed.")
    restarts = Family("axond_job_restarts_total", "counter", "Times the job was restarted after a failure.")
    for j in snap.jobs:
        job_state.add(1, job=j.job, state=j.state.name.lower())
        generation.add(j.generation, job=j.job)
        world.add(j.world_size, job=j.job)
        job_nodes.add(j.nnodes, job=j.job)
        rendezvous.add(j.generation if j.world_size else j.generation - 1, job=j.job)
        restarts.add(j.restarts, job=j.job)
    total = Family("axond_rendezvous_total", "counter", "Completed rendezvous rounds of the jobs kept in the status.")
    total.add(sum(s[2] for s in rendezvous.samples))
    kv = Family("axond_kv_ops_total", "counter", "KV store and barrier calls served, by operation.")
    for op in KV_OPS:
        kv.add(kv_ops.get(op, 0), op=op)
    return [nodes, age, worst, jobs, job_state, generation, world, job_nodes, rendezvous, restarts, total, kv,
            *goodput_families(snap)]


def render_coordinator(running: RunningCoordinator) -> str:
    return render(coordinator_families(running))
