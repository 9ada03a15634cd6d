"""What the coordinator's counters count: completed rendezvous only (a job cancelled while it gathered completed
none and keeps generation 1), and where the worker's metrics endpoint binds (loopback unless told)."""

from __future__ import annotations

import errno
import socket
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2 as pb
from worker_support import Procs, free_port, procs, wait_for  # noqa: F401


def _samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    assert found, f"no sample {name} {labels}"
    return sum(found)


def test_rendezvous_counters_count_only_completed_rounds(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    coord = coordinator_factory(metrics_port=0)
    assert coord.metrics is not None
    with connect(coord.address) as c:
        node = c.register_node("a").node_id
        ran = c.join("ran", node, 1, 1, 1, timeout=10.0)  # one completed rendezvous
        c.report_exit("ran", node, ran.generation, 0)
        failed = c.join("failed", node, 1, 1, 1, timeout=10.0)  # completed, then failed for good
        c.report_failure("failed", node, failed.generation, 0, 3, "boom")
        for name in ("mm", "mm2"):  # submitted, never placed (no daemon), cancelled while pending
            c.submit_job(["true"], 1, 1, job=name)
            c.cancel_job(name)
        jobs = {j.job: j for j in c.get_status(all=True).jobs}
    assert jobs["mm"].state == pb.JOB_STATE_CANCELLED and jobs["mm"].generation == 1, "cancelling moved the generation"
    assert jobs["failed"].state == pb.JOB_STATE_FAILED and jobs["failed"].generation == 1
    got = _samples(coord.metrics.port)
    assert _value(got, "axond_job_rendezvous_total", job="mm") == 0
    assert _value(got, "axond_job_rendezvous_total", job="mm2") == 0
    assert _value(got, "axond_job_rendezvous_total", job="ran") == 1
    assert _value(got, "axond_job_rendezvous_total", job="failed") == 1
    assert _value(got, "axond_rendezvous_total") == 2
    assert _value(got, "axond_job_generation", job="mm") == 1


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return False
    return True


def _answers(port: int) -> bool:
    try:
        _samples(port)
    except OSError as e:  # URLError (its reason) or the connection itself: refused or dropped while the worker starts
        if isinstance(getattr(e, "reason", e), ConnectionError):
            return False
        raise
    return True


RANK = """
import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_the_worker_metrics_endpoint_binds_loopback_unless_told(host: str | None, procs: Procs, tmp_path: Path) -> None:
    """Default: 127.0.0.1 only (127.0.0.2 stays free on the same port); `--metrics-host 0.0.0.0`: every interface."""
    script, flag = tmp_path / "rank.py", tmp_path / "done"
    script.write_text(RANK)
    port = free_port()
    extra = ["--metrics-host", host] if host else []
    w = procs.axond("worker", "--standalone", "--nproc-per-node", "1", "--metrics-port", str(port), *extra,
                    "--", sys.executable, str(script), str(flag))
    try:
        # answering, not merely "the port is taken": another process's outgoing socket may hold it for a moment
        wait_for(lambda: _answers(port), 60, "the worker's metrics endpoint answering")
        assert _value(_samples(port), "axond_worker_ranks_reporting") >= 0
        assert _bindable("127.0.0.2", port) is (host is None)
    finally:
        flag.write_text("done")
    res = procs.finish(w, timeout=60)
    assert res.code == 0, res.stderr
    assert f"metrics at http://{host or '127.0.0.1'}:{port}/metrics" in res.stderr
