"""The client library: connect() settings, error translation, bounded retries (the coordinator's Store keeps the
contract every store keeps: tests/init/test_store_contract.py)."""

from __future__ import annotations

import socket
import time

import pytest

from axond.control.channel import normalize_address
from axond.control.client import connect
from axond.errors import CoordinatorError, StoreError


def test_connect_reads_the_environment(monkeypatch: pytest.MonkeyPatch, coordinator_factory) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("AXOND_COORDINATOR", raising=False)
    with pytest.raises(CoordinatorError, match="--coordinator HOST:PORT or set AXOND_COORDINATOR"):
        connect()
    running = coordinator_factory(token="tok")
    monkeypatch.setenv("AXOND_COORDINATOR", running.address)
    monkeypatch.setenv("AXOND_TOKEN", "tok")
    with connect(call_timeout=5.0) as c:
        assert c.address == running.address
        assert c.get_status().nodes == []


def test_address_forms() -> None:
    assert normalize_address("host") == "host:29500"
    assert normalize_address("grpc://host:1234") == "host:1234"
    assert normalize_address("[::1]:80") == "[::1]:80"
    assert normalize_address("[::1]") == "[::1]:29500"
    with pytest.raises(CoordinatorError, match="no valid port"):
        normalize_address("host:port")


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_unreachable_coordinator_fails_fast_after_bounded_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with connect(f"127.0.0.1:{port}", call_timeout=3.0) as c:
        t0 = time.monotonic()
        with pytest.raises(CoordinatorError, match=r"GetStatus at coordinator 127\.0\.0\.1:\d+ failed: UNAVAILABLE"):
            c.get_status()
        assert time.monotonic() - t0 < 4.0
        with pytest.raises(StoreError, match="UNAVAILABLE"):
            c.store("j", 1).set("k", b"v")
