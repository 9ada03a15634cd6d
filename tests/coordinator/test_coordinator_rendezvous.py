"""Rendezvous, heartbeats and failures through a real coordinator on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from axond.control.client import CoordinatorClient, connect
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2 as pb


def join_all(
    client: CoordinatorClient, node_ids: list[str], nproc: int, min_nodes: int, max_nodes: int, **kw: float
) -> list[pb.JoinResponse]:
    with ThreadPoolExecutor(len(node_ids)) as pool:
        futures = [
            pool.submit(client.join, "j", n, nproc, min_nodes, max_nodes, timeout=kw.get("timeout", 10.0))
            for n in node_ids
        ]
        return [f.result(timeout=30) for f in futures]


@pytest.mark.parametrize("nnodes", [1, 2, 8])
def test_rendezvous_assigns_unique_contiguous_ranks(client: CoordinatorClient, nnodes: int) -> None:
    ids = [client.register_node(f"host{i % 3}").node_id for i in range(nnodes)]
    got = join_all(client, ids, 2, nnodes, nnodes)
    ranks = sorted(r for g in got for r in range(g.rank_offset, g.rank_offset + g.local_world_size))
    assert ranks == list(range(2 * nnodes))
    assert sorted(g.node_rank for g in got) == list(range(nnodes))
    assert {(g.world_size, g.nnodes, g.generation) for g in got} == {(2 * nnodes, nnodes, 1)}
    assert len({g.job_secret for g in got}) == 1 and len(got[0].job_secret) == 16
    for g in got:
        assert g.rank_offset == 2 * g.node_rank
    status = client.get_status("j")
    assert status.jobs[0].state == pb.JOB_STATE_RUNNING
    assert sorted(r.rank for r in status.jobs[0].ranks) == list(range(2 * nnodes))


def test_ranks_are_deterministic_across_coordinators(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    layouts = []
    for _ in range(2):
        running = coordinator_factory()
        with connect(running.address, call_timeout=5.0) as c:
            ids = [c.register_node(h).node_id for h in ["zeta", "alpha", "mid", "alpha"]]
            got = join_all(c, ids, 3, 4, 4)
            layouts.append([(g.node_rank, g.rank_offset) for g in got])
    assert layouts[0] == layouts[1] == [(3, 9), (0, 0), (2, 6), (1, 3)]


def test_min_max_takes_a_late_joiner_within_settle_time(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(settle_time=1.0)
    with connect(running.address, call_timeout=5.0) as c, ThreadPoolExecutor(3) as pool:
        ids = [c.register_node(f"h{i}").node_id for i in range(3)]
        t0 = time.monotonic()
        early = [pool.submit(c.join, "j", n, 1, 2, 4, timeout=10.0) for n in ids[:2]]
        time.sleep(0.3)
        late = pool.submit(c.join, "j", ids[2], 1, 2, 4, timeout=10.0)
        got = [f.result(timeout=15) for f in [*early, late]]
        elapsed = time.monotonic() - t0
    assert {g.world_size for g in got} == {3}
    assert 0.9 < elapsed < 5.0, f"froze after {elapsed:.2f} s; expected settle_time 1.0 s after MIN"


def test_min_max_freezes_at_min_after_settle_and_at_max_at_once(
    coordinator_factory: Callable[..., RunningCoordinator],
) -> None:
    running = coordinator_factory(settle_time=0.3)
    with connect(running.address, call_timeout=5.0) as c:
        ids = [c.register_node(f"h{i}").node_id for i in range(2)]
        got = join_all(c, ids, 1, 2, 3)
        assert {g.world_size for g in got} == {2}
        ids = [c.register_node(f"k{i}").node_id for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            got = [f.result(timeout=10) for f in [pool.submit(c.join, "k", n, 1, 2, 3, timeout=10.0) for n in ids]]
        assert {g.world_size for g in got} == {3}


def test_join_times_out_with_a_clear_message_and_leaves_the_round(client: CoordinatorClient) -> None:
    a, b = (client.register_node(h).node_id for h in ("a", "b"))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="DEADLINE_EXCEEDED.*1 node\\(s\\) joined.*start the missing workers"):
        client.join("j", a, 1, 2, 2, timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(Exception, match="1 node\\(s\\) joined"):
        client.join("j", b, 1, 2, 2, timeout=0.3)  # had `a` stayed in the round, this join would complete


def test_heartbeat_loss_bumps_generation_and_survivor_learns_it(
    coordinator_factory: Callable[..., RunningCoordinator],
) -> None:
    running = coordinator_factory(heartbeat_interval=0.1, dead_after_missed=3)
    with connect(running.address, call_timeout=5.0) as c:
        reg = c.register_node("alive")
        assert reg.heartbeat_interval_s == pytest.approx(0.1) and reg.dead_after_missed == 3
        alive, silent = reg.node_id, c.register_node("silent").node_id
        got = _join_pair(c, alive, silent, max_restarts=1)
        assert {g.generation for g in got} == {1}
        deadline = time.monotonic() + 5.0
        hb = c.heartbeat(alive, "j", 1)
        while hb.generation == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            hb = c.heartbeat(alive, "j", 1)
        assert hb.generation == 2, "the silent node was not declared dead within 5 s"
        assert hb.job_state == pb.JOB_STATE_RESTARTING and silent in hb.reason and "missed 3 heartbeats" in hb.reason
        health = {n.node_id: n.health for n in c.get_status().nodes}
        assert health[silent] == pb.NODE_HEALTH_DEAD and health[alive] == pb.NODE_HEALTH_ALIVE


def test_report_failure_restarts_until_restarts_run_out(client: CoordinatorClient) -> None:
    a, b = (client.register_node(h).node_id for h in ("a", "b"))
    for gen, will in ((1, True), (2, False)):
        got = [f for f in _join_pair(client, a, b, max_restarts=1)]
        assert {g.generation for g in got} == {gen} and {g.restarts_left for g in got} == {2 - gen}
        resp = client.report_failure("j", b, gen, 1, 3, "segfault")
        after = gen + 1 if will else gen  # a job that ends keeps the generation it ended in
        assert (resp.generation, resp.will_restart) == (after, will)
        hb = client.heartbeat(a, "j", gen)
        assert hb.generation == after and "rank 1" in hb.reason and "segfault" in hb.reason
    assert client.heartbeat(a, "j", 2).job_state == pb.JOB_STATE_FAILED
    job = client.get_status("j").jobs[0]
    assert (job.state, job.restarts, job.max_restarts) == (pb.JOB_STATE_FAILED, 1, 1)


def _join_pair(client: CoordinatorClient, a: str, b: str, max_restarts: int) -> list[pb.JoinResponse]:
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client.join, "j", n, 1, 2, 2, max_restarts, 10.0) for n in (a, b)]
        return [f.result(timeout=15) for f in futures]


def test_report_exit_finishes_the_job(client: CoordinatorClient) -> None:
    a, b = (client.register_node(h).node_id for h in ("a", "b"))
    _join_pair(client, a, b, 0)
    client.report_exit("j", a, 1, 0)
    client.report_exit("j", b, 1, 0)
    assert client.get_status("j").jobs[0].state == pb.JOB_STATE_SUCCEEDED
    client.deregister_node(a)
    assert [n.node_id for n in client.get_status().nodes] == [b]
