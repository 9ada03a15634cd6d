"""The coordinator's goodput metrics: each job's wall time, where it went by cause, and the productive share.

Read from the same status snapshot as the rest of the coordinator's /metrics (`coordinator_metrics`); the
accounting itself is `axond.coordinator.state.goodput`.
"""

from __future__ import annotations

from typing import Any

from axond.observe.exposition import Family


def goodput_families(snap: Any) -> list[Family]:
    """`axond_job_wall_seconds`, `axond_job_time_seconds_total` (by cause) and `axond_job_goodput_ratio` of every
    job of the status snapshot `snap`."""
    wall = Family("axond_job_wall_seconds", "gauge", "Seconds from the job's creation to its end (or now).")
    parts = Family("axond_job_time_seconds_total", "counter",
                   "Seconds of the job's wall time by cause: productive, startup, waiting_for_members, detection, "
                   "reformation, hung (they add up to axond_job_wall_seconds).")
    ratio = Family("axond_job_goodput_ratio", "gauge", "Productive seconds over wall seconds of the job (goodput).")
    for j in snap.jobs:
        if not j.goodput:
            continue
        wall.add(j.wall_s, job=j.job)
        for cause, seconds in j.goodput:
            parts.add(seconds, job=j.job, cause=cause)
        productive = dict(j.goodput).get("productive", 0.0)
        ratio.add(productive / j.wall_s if j.wall_s > 0 else 0.0, job=j.job)
    return [wall, parts, ratio]
