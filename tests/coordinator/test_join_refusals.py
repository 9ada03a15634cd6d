"""Joins refused at once, and pending jobs that end, through a real coordinator on loopback (fast, no processes).

The worker-level view (messages, progress lines) is in tests/worker/test_worker_talks.py.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from axond.control.client import CoordinatorClient
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb


def _job(client: CoordinatorClient, name: str) -> pb.JobStatus | None:
    return next((j for j in client.get_status("", all=True).jobs if j.job == name), None)


def test_a_mismatched_join_is_refused_at_once_and_the_pending_job_says_so(client: CoordinatorClient) -> None:
    a, b = (client.register_node(h).node_id for h in ("host-a", "host-b"))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.join, "j", a, 1, 2, 2, timeout=5.0)
        deadline = time.monotonic() + 5
        while _job(client, "j") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(CoordinatorError, match="runs with nnodes 2:2 .* asks 3:3"):
            client.join("j", b, 1, 3, 3, timeout=5.0)
        assert time.monotonic() - t0 < 2.0, "refused at once, not after the join timeout"
        job = _job(client, "j")
        assert job is not None and job.state == pb.JOB_STATE_PENDING
        assert job.reason.startswith("refused a worker on host-b") and "it asked nnodes 3:3" in job.reason
        got = client.join("j", b, 1, 2, 2, timeout=5.0)  # the right options still join
        assert waiting.result(timeout=10).world_size == got.world_size == 2
    job = _job(client, "j")
    assert job is not None and job.state == pb.JOB_STATE_RUNNING and job.reason == "", "the note ends at the freeze"


def test_a_full_running_job_refuses_a_newcomer_at_once(client: CoordinatorClient) -> None:
    a, b = (client.register_node(h).node_id for h in ("host-a", "host-b"))
    client.join("j", a, 2, 1, 1, timeout=5.0)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError, match="is running with all its 1 node"):
        client.join("j", b, 2, 1, 1, timeout=5.0)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("how", ["join timeout", "deregistered"])
def test_a_pending_job_no_live_node_waits_for_ends(client: CoordinatorClient, how: str) -> None:
    a = client.register_node("host-a").node_id
    if how == "join timeout":
        with pytest.raises(CoordinatorError):
            client.join("j", a, 1, 2, 2, timeout=0.3)
    else:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.join, "j", a, 1, 2, 2, timeout=5.0)
            deadline = time.monotonic() + 5
            while _job(client, "j") is None and time.monotonic() < deadline:
                time.sleep(0.02)
            client.deregister_node(a)
            with pytest.raises(CoordinatorError):
                waiting.result(timeout=10)
    job = _job(client, "j")
    assert job is not None and job.state == pb.JOB_STATE_CANCELLED
    assert "no live node waits in its rendezvous" in job.reason
    b = client.register_node("host-b").node_id
    with ThreadPoolExecutor(1) as pool:  # the name is free again: a new worker starts the job afresh
        again = pool.submit(client.join, "j", b, 1, 2, 2, timeout=5.0)
        deadline = time.monotonic() + 5
        while getattr(_job(client, "j"), "state", None) != pb.JOB_STATE_PENDING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert getattr(_job(client, "j"), "state", None) == pb.JOB_STATE_PENDING
        c = client.register_node("host-c").node_id
        assert client.join("j", c, 1, 2, 2, timeout=5.0).world_size == 2
        again.result(timeout=10)
