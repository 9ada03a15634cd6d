"""Status for operators: retention of finished jobs and dead nodes, hosts and pids, rendezvous progress."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from axond.control.client import CoordinatorClient, connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import RunningCoordinator
from axond.coordinator.state.machine import CoordinatorState
from axond.errors import StoreError
from axond.testing.waits import wait_until


def test_finished_jobs_and_dead_nodes_age_out_of_the_default_view() -> None:
    state = CoordinatorState(heartbeat_interval=1.0, dead_after_missed=2, limits=CoordinatorLimits(status_retention_s=10))
    a = state.register_node("a", 0, False, now=0.0).node_id
    b = state.register_node("b", 0, False, now=0.0).node_id
    state.join("done", a, 1, 1, 1, 0, now=0.0)
    state.report_exit("done", a, 1, 0, now=1.0)
    state.heartbeat(a, "", 0, now=30.0)
    state.tick(now=30.0)  # b is dead since ~2 s
    assert [j.job for j in state.status("", now=5.0).jobs] == ["done"]
    view = state.status("", now=30.0)
    assert view.jobs == () and [n.node_id for n in view.nodes] == [a]
    everything = state.status("", now=30.0, all=True)
    assert [j.job for j in everything.jobs] == ["done"] and {n.node_id for n in everything.nodes} == {a, b}
    assert everything.jobs[0].finished_age_s == pytest.approx(29.0)
    assert state.status("done", now=30.0).jobs[0].job == "done", "a job asked for by name is always shown"


def test_ranks_show_host_and_pid_and_open_rendezvous_shows_who_joined(client: CoordinatorClient) -> None:
    a = client.register_node("host-a").node_id
    b = client.register_node("host-b").node_id
    waiter = threading.Thread(target=client.join, args=("j", a, 2, 2, 2), kwargs={"timeout": 20.0})
    waiter.start()
    def open_job() -> Any:
        return next((j for j in client.get_status().jobs if j.job == "j" and j.joined_hosts), None)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and open_job() is None:
        time.sleep(0.05)
    job = open_job()
    assert job is not None
    assert list(job.joined_hosts) == ["host-a"] and (job.min_nodes, job.max_nodes, job.nnodes) == (2, 2, 1)
    client.join("j", b, 2, 2, 2, timeout=20.0)
    waiter.join(20.0)
    client.heartbeat(a, "j", 1, local_pids=[4242, 4243])
    job = client.get_status("j").jobs[0]
    assert [(r.rank, r.hostname, r.pid) for r in job.ranks] == [
        (0, "host-a", 4242), (1, "host-a", 4243), (2, "host-b", 0), (3, "host-b", 0)]
    assert not job.joined_hosts


def test_store_waiters_of_an_old_generation_learn_why_at_once(coordinator: RunningCoordinator,
                                                             client: CoordinatorClient) -> None:
    a = client.register_node("a").node_id
    b = client.register_node("b").node_id
    threads = [threading.Thread(target=client.join, args=("j", n, 1, 2, 2), kwargs={"timeout": 20.0}) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    errors: list[BaseException] = []

    def wait_for_peer() -> None:
        with connect(coordinator.address, call_timeout=5.0) as c:
            try:
                c.store("j", 1).get("peer-address", timeout=60.0)
            except StoreError as e:
                errors.append(e)

    t0 = time.monotonic()
    waiter = threading.Thread(target=wait_for_peer)
    waiter.start()
    time.sleep(0.3)
    client.report_failure("j", b, 1, 1, 3, "rank 1 exited before init_process_group")
    waiter.join(20.0)
    assert time.monotonic() - t0 < 10.0
    assert len(errors) == 1 and "is over" in str(errors[0]) and "exited before init_process_group" in str(errors[0])


def test_status_retention_is_configurable(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    retention = 0.2
    running = coordinator_factory(limits=CoordinatorLimits(status_retention_s=retention))
    with connect(running.address, call_timeout=5.0) as c:
        node = c.register_node("h").node_id
        c.join("j", node, 1, 1, 1, timeout=5.0)
        before = time.monotonic()
        c.report_exit("j", node, 1, 0)
        wait_until(lambda: not c.get_status().jobs, 50 * retention, "the finished job to leave the status")
        assert time.monotonic() - before >= retention, "dropped before its retention ran out"
        assert [j.job for j in c.get_status(all=True).jobs] == ["j"]
        assert c.join("j", node, 1, 1, 1, timeout=5.0).generation == 1, "a finished name starts again at 1"
