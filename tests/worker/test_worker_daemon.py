"""Daemon mode: output forwarding, output completeness, and surviving a coordinator restart."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import pytest

from axond.control.client import CoordinatorClient, connect
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2 as pb
from axond.worker.daemon import OutputForwarder
from worker_support import FAST, Procs, coord, free_port, procs  # noqa: F401

PY = sys.executable


def _events(client: CoordinatorClient, job: str) -> list[pb.JobEvent]:
    return list(client.stream_job(job, timeout=20))


def test_forwarder_sends_every_line_in_order_before_flush_returns(coord: RunningCoordinator) -> None:
    with connect(coord.address, call_timeout=5.0) as client:
        node = client.register_node("fwd-host", slots=1, daemon=True).node_id
        job = client.submit_job([PY, "-c", "pass"], 1, 1, job="fwd")
        client.poll_work(node, 1.0)
        fwd = OutputForwarder(client, job, node, max_batch_lines=100)
        try:
            for i in range(2500):
                fwd.sink(i % 3, "stdout" if i % 2 else "stderr", f"line {i}")
            fwd.flush(timeout=20)
            gen = client.join(job, node, 1, 1, 1, timeout=10).generation
            client.report_exit(job, node, gen, 0)
        finally:
            fwd.close()
        lines = [e.output for e in _events(client, job) if e.WhichOneof("event") == "output"]
    assert [line.text for line in lines] == [f"line {i}" for i in range(2500)]
    assert [(line.rank, line.stream) for line in lines[:2]] == [(0, "stderr"), (1, "stdout")]


def test_forwarder_queue_is_bounded_and_says_what_it_dropped(coord: RunningCoordinator) -> None:
    with connect(coord.address, call_timeout=5.0) as client:
        node = client.register_node("fwd-host", slots=1, daemon=True).node_id
        job = client.submit_job([PY, "-c", "pass"], 1, 1, job="bounded")
        client.poll_work(node, 1.0)
        fwd = OutputForwarder(client, "no-such-job", node, max_pending=50)
        for i in range(500):
            fwd.sink(0, "stdout", f"line {i}")
        assert len(fwd._pending) <= 51
        fwd.close(timeout=5)
        assert not fwd._thread.is_alive(), "close gives up on lines the coordinator refuses"
        client.cancel_job(job)


def test_run_gets_all_output_before_the_job_ends(coord: RunningCoordinator, procs: Procs) -> None:
    procs.axond("worker", "--coordinator", coord.address, "--slots", "2")
    script = "import os\nfor i in range(3000): print(os.environ['RANK'], i)"
    t0 = time.monotonic()
    res = procs.run("run", "--coordinator", coord.address, "--nnodes", "1", "--nproc-per-node", "2",
                    "--", PY, "-c", script, timeout=60)
    elapsed = time.monotonic() - t0
    assert res.code == 0, res.stderr
    assert elapsed < 20, f"`axond run` took {elapsed:.1f} s: StreamJob missed a wake-up (events appended while it yielded)"
    for rank in (0, 1):
        got = [line for line in res.stdout.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert got == [f"[rank {rank}] {rank} {i}" for i in range(3000)]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_daemon_registers_again_after_a_coordinator_restart(
    coordinator_factory: Callable[..., RunningCoordinator], procs: Procs
) -> None:
    port = free_port()
    first = coordinator_factory(port=port, **FAST)
    daemon = procs.axond("worker", "--coordinator", first.address, "--slots", "1")
    with connect(first.address, call_timeout=5.0) as client:
        deadline = time.monotonic() + 20
        while not client.get_status().nodes:
            assert time.monotonic() < deadline, "the daemon did not register"
            time.sleep(0.1)
    first.stop(grace=0.2)
    second = coordinator_factory(port=port, **FAST)
    res = procs.run("run", "--coordinator", second.address, "--nnodes", "1", "--", PY, "-c", "print('again')",
                    timeout=60)
    assert res.code == 0, res.stderr
    assert "[rank 0] again" in res.stdout
    assert daemon.poll() is None, "the daemon keeps running"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_run_with_max_restarts_recovers_on_daemons(coord: RunningCoordinator, procs: Procs) -> None:
    for _ in range(2):
        procs.axond("worker", "--coordinator", coord.address, "--slots", "1")
    script = (
        "import os, sys\n"
        "gen, rank = os.environ['AXOND_GENERATION'], os.environ['RANK']\n"
        "print('GEN', gen, 'RANK', rank, flush=True)\n"
        "sys.exit(6 if gen == '1' and rank == '1' else 0)\n"
    )
    res = procs.run("run", "--coordinator", coord.address, "--nnodes", "2", "--max-restarts", "1",
                    "--", PY, "-c", script, timeout=60)
    assert res.code == 0, res.stderr
    assert {"[rank 0] GEN 2 RANK 0", "[rank 1] GEN 2 RANK 1"} <= set(res.stdout.splitlines())
    assert "restarting as generation 2" in res.stderr
