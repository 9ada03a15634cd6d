"""The coordinator's state heals: a full disk is written again once space returns; read-only or corrupt state is
refused at start.

The full and read-only disks are small tmpfs mounts the test makes (root only; skipped with the reason
otherwise); a real coordinator serves from them, with a real client.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from axond.control.client import connect
from axond.store.coordinator import CoordinatorStore
from axond.coordinator.persistence import group_commit
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError, StoreError

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> None:
    """Write `path` until the file system is full."""
    chunk = b"\0" * (64 << 10)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_full_state_disk_heals_without_a_restart_and_loses_nothing_acknowledged(
        coordinator_factory: Callable[..., RunningCoordinator], small_disk: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_commit, "RETRY_INTERVAL_S", 0.2)
    state = small_disk / "state"
    running = coordinator_factory(in_memory=False, state_dir=str(state))
    acked: dict[str, bytes] = {}
    with connect(running.address, token=running.token, call_timeout=3.0) as c:
        node = c.register_node("h").node_id
        c.join("j", node, 1, 1, 1, timeout=5.0)
        store = CoordinatorStore(c, "j", 1, streamed=False)
        store.set("before", b"1")
        acked["before"] = b"1"
        fill(small_disk / "filler")
        # Keep writing until a write fails for want of space; every write answered OK was acknowledged.
        failed = None
        for i in range(200):
            value = os.urandom(32 << 10)
            try:
                store.set(f"k{i}", value)
                acked[f"k{i}"] = value
            except StoreError as e:
                failed = e
                break
        assert failed is not None and "could not write its state" in str(failed), failed
        assert c.check_health() == NOT_SERVING
        assert running.commits is not None and running.commits.failed is not None
        # Space comes back: the coordinator writes the failed batch again and serves by itself.
        (small_disk / "filler").unlink()
        wait_until(lambda: c.check_health() == SERVING, 10, "the coordinator serves again")
        store.set("after", b"2")
        acked["after"] = b"2"
        for key, value in acked.items():
            assert store.get(key, timeout=0) == value, key
        c.heartbeat(node)
        assert [n.health for n in c.get_status().nodes] == [1]  # alive: the outage counted against no lease
    running.stop()
    again = coordinator_factory(in_memory=False, state_dir=str(state))
    with connect(again.address, token=again.token, call_timeout=3.0) as c:
        store = CoordinatorStore(c, "j", 1, streamed=False)
        for key, value in acked.items():
            assert store.get(key, timeout=0) == value, key


def test_read_only_state_is_refused_at_start(coordinator_factory: Callable[..., RunningCoordinator],
                                             small_disk: Path) -> None:
    state = small_disk / "state"
    first = coordinator_factory(in_memory=False, state_dir=str(state))
    first.stop()
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pytest.raises(CoordinatorError, match="read-only"):
        coordinator_factory(in_memory=False, state_dir=str(state))


def test_corrupt_state_is_refused_at_start(coordinator_factory: Callable[..., RunningCoordinator],
                                           tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = coordinator_factory(in_memory=False, state_dir=str(state))
    with connect(first.address, token=first.token, call_timeout=3.0) as c:
        c.register_node("h")
    first.stop()
    db = state / "coordinator.db"
    data = bytearray(db.read_bytes())
    data[100:4096] = os.urandom(3996)  # the schema page: SQLite finds it damaged
    db.write_bytes(bytes(data))
    for extra in ("coordinator.db-wal", "coordinator.db-shm"):
        (state / extra).unlink(missing_ok=True)
    with pytest.raises(CoordinatorError, match="corrupt|cannot be read"):
        coordinator_factory(in_memory=False, state_dir=str(state))

