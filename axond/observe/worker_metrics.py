"""The worker's /metrics: the collective counters its ranks write into its metrics directory, and its stragglers.

A worker started with `--metrics-port` gives its ranks `AXOND_METRICS_DIR` (a private directory it made);
each rank keeps `rank-JOB-RANK.json` there up to date (see rank_metrics), and a scrape turns those files into
per-rank families labelled job, rank, op and group.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from axond.observe.exposition import Family, render
from axond.observe.http import MetricsServer


def _rank_files(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or not one of ours
        if isinstance(data, dict) and isinstance(data.get("ops"), list):
            out.append(data)
    return out


def worker_families(directory: Path) -> list[Family]:
    """The families of the rank files in `directory`, now."""
    calls = Family("axond_collective_calls_total", "counter", "Collective calls finished, by rank, op and group.")
    nbytes = Family("axond_collective_bytes_total", "counter",
                    "Bytes of the arrays passed to collectives, by rank, op and group.")
    seconds = Family("axond_collective_seconds", "histogram",
                     "Collective latency from the call to its completion (async ops: to their Work's completion).")
    blocked = Family("axond_collective_blocked_seconds_total", "counter",
                     "Time the rank's threads were blocked in collectives and in waits for their Work.")
    ranks = Family("axond_worker_ranks_reporting", "gauge", "Local ranks whose collective counters this worker has.")
    files = _rank_files(directory)
    for data in files:
        bounds = [float(b) for b in data.get("bounds", [])]
        base = {"job": str(data.get("job", "")), "rank": str(data.get("rank", ""))}
        for op in data["ops"]:
            try:
                labels = {**base, "op": str(op["op"]), "group": str(op["group"])}
                calls.add(float(op["calls"]), **labels)
                nbytes.add(float(op["bytes"]), **labels)
                blocked.add(float(op["blocked"]), **labels)
                buckets = [int(c) for c in op["buckets"]]
                if len(buckets) == len(bounds) + 1:
                    seconds.add_histogram(bounds, buckets, float(op["seconds"]), **labels)
            except (KeyError, TypeError, ValueError):
                continue
    ranks.add(len(files))
    return [calls, nbytes, seconds, blocked, ranks, *_straggler_families(directory)]


def _straggler_families(directory: Path) -> list[Family]:
    """The worker's straggler tallies (`axond.worker.stragglers` writes `stragglers-JOB.json`)."""
    lost = Family("axond_straggler_seconds_total", "counter",
                  "Seconds the job's other ranks waited for this rank while it was named a straggler.")
    named = Family("axond_straggler", "gauge", "1 while this rank is named a straggler (the others wait for it).")
    for path in sorted(directory.glob("stragglers-*.json")):
        try:
            data = json.loads(path.read_text())
            for rank, tally in dict(data["ranks"]).items():
                labels = {"job": str(data["job"]), "rank": str(rank)}
                lost.add(float(tally["seconds"]), **labels)
                named.add(float(tally["named"]), **labels)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not one of ours
    return [lost, named]


class WorkerMetrics:
    """A worker's metrics: the directory its ranks report into (the worker sets `AXOND_METRICS_DIR` to `directory`
    in its ranks' environment) and the HTTP server; `stop` removes both."""

    def __init__(self, host: str, port: int) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="axond-metrics-"))
        try:
            self.server = MetricsServer(host, port, lambda: render(worker_families(self.directory)))
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
