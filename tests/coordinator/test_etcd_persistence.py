"""EtcdPersistence beyond the shared contract: etcd's limits (large commits, snapshots) and fencing."""

from __future__ import annotations

import time
import uuid

import pytest

from axond.coordinator.persistence import Changes
from axond.coordinator.persistence.etcd import EtcdPersistence, LeaderElection, NotLeader, parse_state_url
from axond.coordinator.persistence.etcd import persistence as etcd_persistence
from axond.coordinator.persistence.etcd.client import prefix_end
from axond.errors import CoordinatorError
from etcd_cluster import EtcdServer, etcd_server  # noqa: F401
from etcd_persistence import lead


def _prefix() -> str:
    return f"/axond-test-{uuid.uuid4().hex[:8]}"


def _kv(i: int, size: int = 8) -> Changes:
    return Changes(kv={("job", f"k{i}"): (1, bytes([i % 256]) * size)})


def test_state_urls() -> None:
    assert parse_state_url("etcd://a:2379,b:2379") == (["a:2379", "b:2379"], "/axond")
    assert parse_state_url("etcd://a:2379/team/x/") == (["a:2379"], "/team/x")
    for bad in ("a:2379", "etcd://", "etcd://a", "etcd://a:b"):
        with pytest.raises(CoordinatorError):
            parse_state_url(bad)


def test_large_commits_and_snapshots_load_back(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit over etcd's request limit goes in pieces; snapshots replace the log; load sees every commit."""
    monkeypatch.setattr(etcd_persistence, "SNAPSHOT_EVERY", 7)
    prefix, client = _prefix(), etcd_server.client()
    election = LeaderElection(client, prefix, "127.0.0.1:1", ttl=5)
    term = lead(election)
    p = EtcdPersistence(client, prefix, term)
    p.load()
    big = Changes(kv={("job", f"big{i}"): (1, bytes([i]) * 900_000) for i in range(3)})  # 3.6 MB as JSON
    p.commit(big)
    for i in range(20):
        p.commit(_kv(i))
    log_keys, _ = client.range(f"{prefix}/log/".encode(), prefix_end(f"{prefix}/log/".encode()))
    assert len(log_keys) < 7, "snapshots dropped the log entries they hold"
    election.resign(term)

    term2 = lead(election)
    snap = EtcdPersistence(client, prefix, term2).load()
    values = {key: value for _, _, key, value in snap.kv}
    assert values == {**{f"big{i}": bytes([i]) * 900_000 for i in range(3)},
                      **{f"k{i}": bytes([i]) * 8 for i in range(20)}}
    election.resign(term2)
    client.close()


def test_a_deposed_leader_cannot_write(etcd_server: EtcdServer) -> None:
    """Once another replica holds the leader key, every write of the old term is refused and nothing lands."""
    prefix, client = _prefix(), etcd_server.client()
    old_election = LeaderElection(client, prefix, "127.0.0.1:1", ttl=2)
    old = lead(old_election)
    deposed = EtcdPersistence(client, prefix, old)
    deposed.load()
    deposed.commit(_kv(1))
    old.ended.set()  # the old leader stalls: it stops renewing and its lease expires
    new_election = LeaderElection(client, prefix, "127.0.0.1:2", ttl=5)
    deadline = time.monotonic() + 10
    new = None
    while new is None and time.monotonic() < deadline:
        new = new_election.try_lead()
        time.sleep(0.1)
    assert new is not None, "the lease of the stalled leader expired and another replica won"
    assert not old.leads()
    with pytest.raises(NotLeader, match="no longer the leader"):
        deposed.commit(_kv(2))
    with pytest.raises(NotLeader):
        deposed.write_snapshot()
    snap = EtcdPersistence(client, prefix, new).load()
    assert [key for _, _, key, _ in snap.kv] == ["k1"], "only the commit made while leading is kept"
    new_election.resign(new)
    client.close()


def test_replica_flags_are_checked() -> None:
    from click.testing import CliRunner

    from axond.cli.main import main

    runner = CliRunner()
    cases = {
        ("--state", "etcd://127.0.0.1:2379"): "share one token",
        ("--state", "etcd://127.0.0.1:2379", "--token", "t", "--in-memory"): "drop --in-memory",
        ("--advertise", "h:1"): "pass --state",
        ("--state", "etcd://127.0.0.1", "--token", "t"): "has no port",
    }
    for flags, message in cases.items():
        result = runner.invoke(main, ["coordinator", "--port", "0", *flags])
        assert result.exit_code != 0 and message in result.output, (flags, result.output)
