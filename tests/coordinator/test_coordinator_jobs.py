"""Submitted jobs: submit, daemon poll, join, output push, streaming and cancel, over gRPC."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from axond.control.client import CoordinatorClient
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb


def collect(client: CoordinatorClient, job: str, out: list[pb.JobEvent]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.extend(client.stream_job(job, timeout=20.0)))
    t.start()
    return t


def test_submit_poll_push_stream_cycle(client: CoordinatorClient) -> None:
    job = client.submit_job(["python", "train.py"], nnodes=2, nproc_per_node=2, env={"SEED": "1"}, cwd="/w")
    events: list[pb.JobEvent] = []
    streamer = collect(client, job, events)
    daemons = [client.register_node(h, slots=2, daemon=True).node_id for h in ("d0", "d1")]
    polls = [client.poll_work(d, wait_s=5.0) for d in daemons]
    for p in polls:
        (a,) = p.assignments
        assert (a.job, a.nnodes, a.nproc_per_node, list(a.argv), dict(a.env), a.cwd) == (
            job, 2, 2, ["python", "train.py"], {"SEED": "1"}, "/w"
        )
    t0 = time.monotonic()
    assert not client.poll_work(daemons[0], wait_s=0.2).assignments, "an assignment is delivered once"
    assert time.monotonic() - t0 >= 0.15
    with ThreadPoolExecutor(2) as pool:
        joins = [f.result(timeout=10) for f in [pool.submit(client.join, job, d, 2, 2, 2, 0, 10.0) for d in daemons]]
    for d, j in zip(daemons, joins):
        lines = [pb.OutputLine(rank=j.rank_offset + i, stream="stdout", text=f"hello from {j.rank_offset + i}") for i in range(2)]
        client.push_output(job, d, lines)
        client.report_exit(job, d, j.generation, 0)
    streamer.join(timeout=10)
    assert not streamer.is_alive()
    outputs = sorted(e.output.text for e in events if e.HasField("output"))
    assert outputs == [f"hello from {r}" for r in range(4)]
    assert any("waiting for 2 worker daemon(s)" in e.info for e in events if e.HasField("info"))
    assert events[-1].HasField("finished") and events[-1].finished.exit_code == 0
    late = list(client.stream_job(job, timeout=5.0))
    assert [e.output.text for e in late if e.HasField("output")] == [e.output.text for e in events if e.HasField("output")]


def test_poll_work_wakes_when_a_job_is_submitted(client: CoordinatorClient) -> None:
    daemon = client.register_node("d", slots=4, daemon=True).node_id
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        poll = pool.submit(client.poll_work, daemon, 10.0)
        time.sleep(0.2)
        job = client.submit_job(["true"], nnodes=1, nproc_per_node=4)
        got = poll.result(timeout=10)
    assert [a.job for a in got.assignments] == [job] and time.monotonic() - t0 < 5.0


def test_failed_rank_finishes_the_stream_with_its_exit_code(client: CoordinatorClient) -> None:
    daemon = client.register_node("d", slots=1, daemon=True).node_id
    job = client.submit_job(["false"], nnodes=1, nproc_per_node=1, job="bad")
    assert job == "bad"
    client.poll_work(daemon, 1.0)
    j = client.join(job, daemon, 1, 1, 1, 0, timeout=5.0)
    resp = client.report_failure(job, daemon, j.generation, 0, 3, "exit 3")
    assert not resp.will_restart
    events = list(client.stream_job(job, timeout=5.0))
    assert events[-1].finished.exit_code == 3 and "exit 3" in events[-1].finished.message


def test_cancel_reaches_daemon_and_stream(client: CoordinatorClient) -> None:
    daemon = client.register_node("d", slots=1, daemon=True).node_id
    job = client.submit_job(["sleep", "100"], nnodes=1, nproc_per_node=1)
    assert [a.job for a in client.poll_work(daemon, 1.0).assignments] == [job]
    client.cancel_job(job)
    client.cancel_job(job)
    assert list(client.poll_work(daemon, 1.0).cancelled) == [job]
    events = list(client.stream_job(job, timeout=5.0))
    assert events[-1].finished.exit_code == 130
    assert client.get_status(job).jobs[0].state == pb.JOB_STATE_CANCELLED


def test_submit_errors(client: CoordinatorClient) -> None:
    with pytest.raises(CoordinatorError, match="INVALID_ARGUMENT.*needs a command"):
        client.submit_job([], nnodes=1, nproc_per_node=1)
    with pytest.raises(CoordinatorError, match="INVALID_ARGUMENT.*nnodes is 0"):
        client.submit_job(["x"], nnodes=0, nproc_per_node=1)
    client.submit_job(["x"], nnodes=1, nproc_per_node=1, job="dup")
    with pytest.raises(CoordinatorError, match="ALREADY_EXISTS"):
        client.submit_job(["x"], nnodes=1, nproc_per_node=1, job="dup")
    agent = client.register_node("a").node_id
    with pytest.raises(CoordinatorError, match="FAILED_PRECONDITION.*daemon"):
        client.poll_work(agent, 0.0)
