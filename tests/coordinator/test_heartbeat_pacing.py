"""Liveness at cluster scale: the coordinator asks for at most `max_heartbeat_rate` heartbeats per second from all
nodes together, so each node's interval (and lease) grows with the node count; nodes pace themselves by what they
were told, failure detection never outruns it, and a restarted coordinator remembers it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from axond.control.client import connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.state.membership import Health
from axond.coordinator.server import RunningCoordinator
from axond.coordinator.state.machine import CoordinatorState
from axond.worker.heartbeat import Heartbeater


def test_intervals_grow_with_the_node_count_and_detection_follows_them() -> None:
    state = CoordinatorState(1.0, 3, 0.0, limits=CoordinatorLimits(max_heartbeat_rate=2.0))
    nodes = [state.register_node(f"h{i}", 0, False, 0.0) for i in range(5)]
    assert [n.interval for n in nodes] == [1.0, 1.0, 1.5, 2.0, 2.5]  # max(1 s, nodes / 2 per s) when each registered
    assert state.heartbeat(nodes[0].node_id, "", 0, 1.0).interval == 2.5  # now told the cluster's interval
    members = state.members
    assert members.paced(nodes[0]) == 2.5
    assert members.health(nodes[0], 1.0 + 3.0) is Health.ALIVE  # 1.2 intervals of 2.5 s: not even suspect
    silent = members.newly_dead(1.0 + 7.0)  # 8 s: the others were last heard at 0, each past its 3 intervals
    assert [n.node_id for n in silent] == [n.node_id for n in nodes[1:]]  # node 0: 3 x 2.5 s since 1 s not passed
    assert members.newly_dead(1.0 + 7.6) == [nodes[0]]


def test_a_shrinking_cluster_gives_a_node_until_its_next_heartbeat_at_the_old_pace() -> None:
    state = CoordinatorState(1.0, 2, 0.0, limits=CoordinatorLimits(max_heartbeat_rate=1.0))
    nodes = [state.register_node(f"h{i}", 0, False, 0.0) for i in range(4)]
    state.heartbeat(nodes[0].node_id, "", 0, 0.0)
    assert nodes[0].interval == 4.0
    for n in nodes[1:]:
        state.deregister_node(n.node_id, 0.0)
    assert state.heartbeat(nodes[0].node_id, "", 0, 1.0).interval == 1.0  # told 1 s, may still be at 4 s once
    assert state.members.paced(nodes[0]) == 4.0
    state.heartbeat(nodes[0].node_id, "", 0, 2.0)  # paced by the new interval since
    assert state.members.paced(nodes[0]) == 1.0


def test_the_worker_heartbeats_at_the_interval_it_is_told(coordinator_factory: Callable[..., RunningCoordinator]) -> None:

    running = coordinator_factory(heartbeat_interval=0.2, limits=CoordinatorLimits(max_heartbeat_rate=5.0))
    client = connect(running.address, call_timeout=5.0)
    try:
        replies = [client.register_node(f"h{i}") for i in range(3)]
        assert [r.heartbeat_interval_s for r in replies] == [0.2, 0.4, 0.6]
        hb = Heartbeater(client, replies[0].node_id, replies[0].heartbeat_interval_s,
                         lease=replies[0].heartbeat_interval_s * replies[0].dead_after_missed).start()
        try:
            deadline = time.monotonic() + 5.0
            while hb.interval != 0.6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert hb.interval == 0.6 and abs(hb.lease - 0.6 * replies[0].dead_after_missed) < 1e-9
        finally:
            hb.stop()
    finally:
        client.close()


def test_a_restarted_coordinator_remembers_each_nodes_interval(coordinator_factory: Callable[..., Any],
                                                               tmp_path: Path) -> None:
    limits = CoordinatorLimits(max_heartbeat_rate=1.0)
    first = coordinator_factory(in_memory=False, state_dir=str(tmp_path), heartbeat_interval=1.0, limits=limits)
    client = connect(first.address, token_file=str(tmp_path / "token"), call_timeout=5.0)
    ids = [client.register_node(f"h{i}").node_id for i in range(3)]
    client.close()
    first.stop(grace=0.2)
    second = coordinator_factory(in_memory=False, state_dir=str(tmp_path), heartbeat_interval=1.0, limits=limits)
    state = second.state
    assert [state.members.get(i).interval for i in ids] == [1.0, 2.0, 3.0]
