"""What the dashboard shows, as JSON-ready data: nodes, jobs with their goodput and its history, their recent pace
(the time between the step ends a rank marks with `axond.mark_step()`, or else between its arrival marks), ranks
with what each reports being blocked in and the stragglers (read from the job generation's store, as `axond status
--job` does).

Read on the coordinator's event loop (where its state changes), like its /metrics, with bounded work: at most
`MAX_RANKS` ranks of each job, and their reports.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from axond.config import StragglerSettings
from axond.coordinator.state.errors import StateError
from axond.coordinator.state.goodput import CAUSES
from axond.distributed.diagnostics.arrivals import KEY as ARRIVALS_KEY
from axond.distributed.diagnostics.arrivals import stragglers
from axond.distributed.diagnostics.inflight import KEY as INFLIGHT_KEY
from axond.distributed.diagnostics.steps import FIELD as STEPS_FIELD

if TYPE_CHECKING:
    from axond.coordinator.server import RunningCoordinator
    from axond.coordinator.state.machine import CoordinatorState

MAX_RANKS = 256
"""Ranks of each job the dashboard lists (and whose reports it reads)."""

READ_TIMEOUT_S = 5.0
"""How long a page's read waits for the coordinator's event loop."""


def _blocked(state: CoordinatorState, job: str, generation: int, rank: int, now: float) -> str:
    """`all_reduce on group 'world' for 12.0 s` from the rank's published report ("" if none or unreadable)."""
    try:
        raw = state.kv_get(job, generation, INFLIGHT_KEY.format(rank))
    except StateError:
        return ""
    if raw is None:
        return ""
    try:
        ops = json.loads(raw).get("ops", [])
        return "; ".join(f"{o['op']} on group '{o['group']}' for {max(now - float(o['since']), 0.0):.1f} s"
                         + (f" (op #{int(o['seq'])} of the group)" if "seq" in o else "") for o in ops)
    except (ValueError, TypeError, KeyError, AttributeError):
        return ""


def _arrivals(state: CoordinatorState, job: str, generation: int, ranks: list[int]) -> dict[int, Any]:
    """rank -> its published arrival marks (`axond.distributed.diagnostics.arrivals`), for the ranks that have some."""
    reports: dict[int, Any] = {}
    for rank in ranks:
        try:
            raw = state.kv_get(job, generation, ARRIVALS_KEY.format(rank))
            data = json.loads(raw) if raw is not None else None
        except (StateError, ValueError):
            continue
        if isinstance(data, dict):
            reports[rank] = data
    return reports


def _stragglers(reports: dict[int, Any]) -> dict[int, str]:
    """rank -> why the others wait for it, for the ranks named stragglers from their published arrival marks
    (the default thresholds: docs/operations.md, "Stragglers")."""
    out: dict[int, str] = {}
    for s in stragglers(reports, StragglerSettings()):
        out.setdefault(s.rank, s.short())
    return out


def _step_times(reports: dict[int, Any]) -> dict[str, Any]:
    """The job's recent step times, from the lowest rank that marks its steps (`axond.mark_step()`): the time between
    two consecutive step ends as [seconds before the newest, ms] points; the ranks of a data-parallel job step
    together, so one rank tells it."""
    for rank in sorted(reports):
        marks = reports[rank].get(STEPS_FIELD)
        if not isinstance(marks, list) or len(marks) < 2:
            continue
        try:
            ends = [(int(n), int(t)) for n, t in marks]
        except (TypeError, ValueError):
            continue
        last = ends[-1][1]
        points = [[round((t - last) / 1e9, 3), round((t - tp) / 1e6, 2)]
                  for (np_, tp), (n, t) in zip(ends, ends[1:]) if n == np_ + 1]
        if points:
            return {"rank": rank, "kind": "steps", "points": points}
    return {}


def _pace(reports: dict[int, Any]) -> dict[str, Any]:
    """The job's recent pace: its step times where a rank marks its steps (`_step_times`), else from the lowest
    rank's arrival marks in its group with the most: the wall time between two consecutive marks (each `ops`
    collectives apart) as [seconds before the newest mark, ms] points; every member of a group keeps the same pace
    (they leave each collective together), so one rank tells it."""
    steps = _step_times(reports)
    if steps:
        return steps
    best: tuple[int, str, int, list[Any]] | None = None
    for rank in sorted(reports):
        for name, data in reports[rank].items():
            marks = data.get("w") if isinstance(data, dict) else None
            if isinstance(marks, list) and (best is None or len(marks) > len(best[3])):
                best = (rank, name, int(data.get("ops", 0) or 0), marks)
        if best is not None:
            break
    if best is None or len(best[3]) < 2:
        return {}
    try:
        t = [int(m[2]) for m in best[3]]
    except (TypeError, ValueError, IndexError):
        return {}
    points = [[round((t[i] - t[-1]) / 1e9, 3), round((t[i] - t[i - 1]) / 1e6, 2)] for i in range(1, len(t))]
    return {"rank": best[0], "kind": "ops", "group": best[1], "ops": best[2], "points": points}


def state_view(state: CoordinatorState) -> dict[str, Any]:
    """The dashboard's data, now."""
    now, wall = time.monotonic(), time.time()
    snap = state.status("", now, all=True, max_ranks=MAX_RANKS)
    nodes = [{"node": n.node_id, "host": n.hostname, "health": n.health.name.lower(),
              "heartbeat_age_s": round(n.last_heartbeat_age_s, 2), "slots": n.slots,
              "mode": "daemon" if n.daemon else "agent", "job": n.job} for n in snap.nodes]
    jobs = []
    for j in snap.jobs:
        running = not j.state.terminal
        clock = state.ctx.goodput.read(j.job, state.jobs.get(j.job), now)
        history = [[round(t, 2), round(w, 3), round(p, 3)] for t, w, p in clock.history] if clock else []
        reports = _arrivals(state, j.job, j.generation, [r.rank for r in j.ranks]) if running else {}
        slow = _stragglers(reports)
        ranks = [{"rank": r.rank, "node": r.node_id, "host": r.hostname, "pid": r.pid, "node_rank": r.node_rank,
                  "local_rank": r.local_rank,
                  "blocked": _blocked(state, j.job, j.generation, r.rank, wall) if running else "",
                  "straggler": slow.get(r.rank, "")}
                 for r in j.ranks]
        jobs.append({
            "job": j.job, "state": j.state.name.lower(), "generation": j.generation, "world_size": j.world_size,
            "nodes": j.nnodes, "restarts": j.restarts, "max_restarts": j.max_restarts, "reason": j.reason,
            "wall_s": round(j.wall_s, 3), "goodput": {c: round(s, 3) for c, s in j.goodput},
            "history": history, "pace": _pace(reports), "ranks": ranks, "ranks_omitted": j.ranks_omitted,
        })
    return {"at": wall, "causes": list(CAUSES), "nodes": nodes, "jobs": jobs}


async def _on_loop(state: CoordinatorState) -> dict[str, Any]:
    return state_view(state)


def read_view(running: RunningCoordinator) -> dict[str, Any]:
    """`state_view` of a running coordinator, taken on its event loop."""
    loop = running._loop
    if loop is not None and loop.is_running():
        return asyncio.run_coroutine_threadsafe(_on_loop(running.state), loop).result(READ_TIMEOUT_S)
    return state_view(running.state)
