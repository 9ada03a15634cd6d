"""`--metrics-port`: the coordinator's and the worker's Prometheus endpoints, scraped during a real job.

The output is parsed with prometheus_client's own parser (dev extra), so it is valid exposition text.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from axond.coordinator.server import RunningCoordinator
from axond.distributed import ProcessGroup
import axond.observe.http as http
from axond.observe.exposition import Family, render
from axond.observe.http import MetricsServer
from axond.observe.settings import ObserveSettings
from axond.testing import run_threads
from worker_support import FAST, Procs, free_port, procs, wait_for  # noqa: F401

RANK_SCRIPT = """
import os, sys, time
import numpy as np
import axond

axond.init_process_group("tcp")
x = np.ones(1024, np.float32)
for _ in range(20):
    axond.all_reduce(x)
axond.barrier()
flag, deadline = sys.argv[1], time.monotonic() + 60
while not os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.05)
axond.barrier()
axond.destroy_process_group()
"""
"""Each rank runs 20 all_reduces of 4 KiB, then waits (bounded) until the test has scraped."""


def scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Sample name -> [(name, labels, value)], parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.name, dict(s.labels), float(s.value)))
    return out


def value(samples: dict[str, list[tuple[str, dict[str, str], float]]], name: str, **labels: str) -> float:
    matching = [v for _, lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    return sum(matching)


def test_the_exposition_text_parses_with_escaped_labels_and_histograms() -> None:
    h = Family("x_seconds", "histogram", "a histogram").add_histogram([0.1, 1.0], [2, 1, 1], 3.5, op="a\"b\\c\nd")
    c = Family("x_total", "counter", "a counter").add(3, job="j")
    parsed = {f.name: f for f in text_string_to_metric_families(render([h, c]))}
    samples = {(s.name, s.labels.get("le", "")): s.value for s in parsed["x_seconds"].samples}
    assert samples[("x_seconds_bucket", "0.1")] == 2 and samples[("x_seconds_bucket", "1.0")] == 3
    assert samples[("x_seconds_bucket", "+Inf")] == 4 and samples[("x_seconds_count", "")] == 4
    assert parsed["x_seconds"].samples[0].labels["op"] == "a\"b\\c\nd"
    assert parsed["x"].type == "counter" and parsed["x"].samples[0].value == 3


def test_only_metrics_is_served_and_a_taken_port_is_refused() -> None:
    server = MetricsServer("127.0.0.1", 0, lambda: "")
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=10)
        assert e.value.code == 404
        with pytest.raises(Exception, match="pick another --metrics-port"):
            MetricsServer("127.0.0.1", server.port, lambda: "")
    finally:
        server.stop()


def test_groups_are_left_alone_when_nothing_observes() -> None:
    """Off (the default), a group's collectives are the class's own methods: no wrapper, no flag per call."""
    assert not ObserveSettings.from_env({}).active

    def methods(group: ProcessGroup) -> list[str]:
        return [op for op in ("all_reduce", "broadcast", "barrier") if op in vars(group)]

    assert run_threads(methods, 2) == [[], []]


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_coordinator_and_worker_metrics_during_a_job(
    coordinator_factory: Callable[..., RunningCoordinator], procs: Procs, tmp_path: Path,
) -> None:
    coord = coordinator_factory(metrics_port=0, **FAST)
    assert coord.metrics is not None
    script, flag = tmp_path / "rank.py", tmp_path / "scraped"
    script.write_text(RANK_SCRIPT)
    worker_port = free_port()
    w = procs.axond("worker", "--coordinator", coord.address, "--job", "watched", "--nproc-per-node", "2",
                    "--metrics-port", str(worker_port), "--", sys.executable, str(script), str(flag))
    try:
        def ranks_reported() -> bool:
            try:
                got = scrape(worker_port)
            except OSError:
                return False
            return all(value(got, "axond_collective_calls_total", rank=str(r), op="all_reduce") >= 20 for r in (0, 1))

        wait_for(ranks_reported, 60, "both ranks' all_reduce counts on the worker's /metrics")
        worker = scrape(worker_port)
        for rank in ("0", "1"):
            labels = {"job": "watched", "rank": rank, "op": "all_reduce", "group": "world"}
            assert value(worker, "axond_collective_calls_total", **labels) == 20
            assert value(worker, "axond_collective_bytes_total", **labels) == 20 * 4096
            assert value(worker, "axond_collective_seconds_count", **labels) == 20
            assert value(worker, "axond_collective_seconds_bucket", le="+Inf", **labels) == 20
            assert value(worker, "axond_collective_blocked_seconds_total", **labels) > 0
            assert value(worker, "axond_collective_calls_total", rank=rank, op="barrier") >= 1
        assert value(worker, "axond_worker_ranks_reporting") == 2

        c = scrape(coord.metrics.port)
        assert value(c, "axond_nodes", health="alive") == 1
        assert value(c, "axond_jobs", state="running") == 1
        assert value(c, "axond_job_state", job="watched", state="running") == 1
        assert value(c, "axond_job_world_size", job="watched") == 2
        assert value(c, "axond_job_rendezvous_total", job="watched") == 1
        assert value(c, "axond_rendezvous_total") >= 1
        assert value(c, "axond_job_restarts_total", job="watched") == 0
        assert value(c, "axond_kv_ops_total", op="set") + value(c, "axond_kv_ops_total", op="get") > 0
        ages = c["axond_node_heartbeat_age_seconds"]
        dead_after = FAST["heartbeat_interval"] * FAST["dead_after_missed"]
        assert len(ages) == 1 and 0 <= ages[0][2] < dead_after, "an alive node was heard from within its lease"
    finally:
        flag.write_text("done")
    res = procs.finish(w, timeout=60)
    assert res.code == 0, res.stderr
    assert f"metrics at http://127.0.0.1:{worker_port}/metrics" in res.stderr
    after = scrape(coord.metrics.port)
    assert value(after, "axond_jobs", state="succeeded") == 1


@pytest.mark.slow
def test_the_coordinator_command_serves_metrics(procs: Procs) -> None:
    port = free_port()
    c = procs.axond("coordinator", "--host", "127.0.0.1", "--port", "0", "--in-memory", "--insecure",
                    "--metrics-port", str(port))
    assert c.stderr is not None
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read() -> None:
        for line in c.stderr or ():
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    seen = ""
    while "metrics at" not in seen:
        seen += lines.get(timeout=30)  # queue.Empty fails the test if the line does not come
    assert f"metrics at http://127.0.0.1:{port}/metrics" in seen
    assert value(scrape(port), "axond_nodes", health="alive") == 0
    c.terminate()
    assert c.wait(timeout=30) == 0


def test_a_silent_scraper_is_dropped_after_the_request_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that never sends its request is closed by the server (its thread freed), not held open."""
    monkeypatch.setattr(http, "REQUEST_TIMEOUT_S", 0.5)
    server = MetricsServer("127.0.0.1", 0, lambda: "")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
            assert conn.recv(1) == b"", "the server closes a silent connection"
    finally:
        server.stop()
