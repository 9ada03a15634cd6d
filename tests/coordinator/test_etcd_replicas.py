"""Coordinator replicas on etcd: one leader, followers redirect, clients fail over, a job outlives its leader."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from axond.control.client import CoordinatorClient, connect
from axond.errors import CoordinatorError
from etcd_cluster import EtcdServer, etcd_server  # noqa: F401
from etcd_replicas import TOKEN, ReplicaSet, replica_set


@pytest.fixture
def replicas(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[ReplicaSet]:
    yield from replica_set(etcd_server, tmp_path)


def test_one_leader_and_the_followers_name_it(replicas: ReplicaSet) -> None:
    for _ in range(3):
        replicas.start()
    leader = replicas.leader()
    followers = [r for r in replicas.replicas if r is not leader]
    assert [replicas.ask(f) for f in followers] == [leader.address] * 2
    with connect(followers[0].address, token=TOKEN, call_timeout=3.0) as one:
        with pytest.raises(CoordinatorError, match=f"follower; the leader is at {leader.address}"):
            one.register_node("h")
    order = ",".join(r.address for r in followers + [leader])
    with connect(order, token=TOKEN, call_timeout=5.0) as client:
        node = client.register_node("h")
        assert node.node_id and client.get_status().nodes[0].node_id == node.node_id


def test_a_stopped_leader_hands_over_and_the_state_follows(replicas: ReplicaSet) -> None:
    for _ in range(2):
        replicas.start()
    first = replicas.leader()
    with connect(replicas.addresses, token=TOKEN, call_timeout=15.0) as client:
        node = client.register_node("h")
        client.join("j", node.node_id, 1, 1, 1)
        store = client.store("j", 1)
        store.set("before", b"1")
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(15) == 0
        t0 = time.monotonic()
        store.set("after", b"2")
        assert time.monotonic() - t0 < 3.0, "a clean stop resigns: the other replica takes over at once"
        assert store.get("before", 1.0) == b"1" and store.get("after", 1.0) == b"2"
        assert replicas.leader() is not first


def test_a_stalled_leader_stops_serving_when_it_wakes(replicas: ReplicaSet) -> None:
    """SIGSTOP the leader past its lease: another replica takes over; the old one, woken, serves nothing more."""
    for _ in range(2):
        replicas.start()
    old = replicas.leader()
    old.process.send_signal(signal.SIGSTOP)
    replicas.paused.append(old)
    new = replicas.leader(timeout=20.0)
    with connect(new.address, token=TOKEN, call_timeout=5.0) as client:
        node = client.register_node("written-by-the-new-leader")
    old.process.send_signal(signal.SIGCONT)
    replicas.paused.remove(old)
    assert replicas.ask(old) != "leader", "the woken replica refuses at once (its term may have ended)"
    assert replicas.leader() is new
    assert replicas.ask(old) == new.address, "and then follows, naming the new leader"
    with connect(replicas.addresses, token=TOKEN, call_timeout=5.0) as client:
        assert [n.node_id for n in client.get_status().nodes] == [node.node_id]


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from axond.control.client import CoordinatorClient, connect
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = connect(call_timeout=20.0).store(os.environ["AXOND_JOB"], int(os.environ["AXOND_GENERATION"]))
    for step in range(int(sys.argv[1])):
        store.set(f"step/{step}/{rank}", str(step).encode())
        for peer in range(world):
            assert store.get(f"step/{step}/{peer}", 60.0) == str(step).encode()
        store.barrier(f"b{step}", world, 60.0)
        time.sleep(0.1)
    kept = sum(store.try_get(f"step/{s}/{p}") is not None for s in range(int(sys.argv[1])) for p in range(world))
    print(f"rank {rank} done, {kept} keys kept", flush=True)
""")


def test_killing_the_leader_mid_job_the_job_goes_on(replicas: ReplicaSet, tmp_path: Path) -> None:
    """A 2-rank job under `axond worker` keeps doing KV calls and barriers while its leader is killed -9.

(Only calls safe to repeat are used: a non-idempotent call in flight when the leader dies fails, as
it does when a single coordinator dies.)"""
    for _ in range(2):
        replicas.start()
    leader = replicas.leader()
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    steps = 40
    worker = subprocess.Popen(
        [sys.executable, "-c", "from axond.cli.main import main; main()", "worker", "--coordinator",
         replicas.addresses, "--token", TOKEN, "--nnodes", "1", "--nproc-per-node", "2", "--job", "ha", "--",
         sys.executable, str(script), str(steps)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        with connect(replicas.addresses, token=TOKEN, call_timeout=15.0) as client:
            deadline = time.monotonic() + 60
            while (client.store("ha", 1).try_get("step/5/1") if "ha" in _jobs(client) else None) is None:
                assert time.monotonic() < deadline and worker.poll() is None, "the job did not get going"
                time.sleep(0.1)
            leader.process.send_signal(signal.SIGKILL)
            leader.process.wait(10)
            killed_at = sum(client.store("ha", 1).try_get(f"step/{s}/1") is not None for s in range(steps))
            out, _ = worker.communicate(timeout=120)
            text = out.decode(errors="replace")
            assert worker.returncode == 0, f"{text}\n{replicas.logs()}"
            assert f"rank 0 done, {2 * steps} keys kept" in text and f"rank 1 done, {2 * steps} keys kept" in text
            assert killed_at < steps, "the leader was killed mid-job"
            assert replicas.leader() is not leader
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def _jobs(client: CoordinatorClient) -> set[str]:
    return {j.job for j in client.get_status().jobs}
