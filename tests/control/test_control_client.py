"""The client library: connect() settings, error translation, bounded retries, and the Store contract
run against both InMemoryStore and the coordinator-backed CoordinatorStore."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from axond.control.channel import normalize_address
from axond.control.client import CoordinatorClient, connect
from axond.store import MAX_VALUE_BYTES, InMemoryStore, PrefixStore, Store
from axond.errors import CoordinatorError, StoreError, StoreTimeout


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


@pytest.fixture(params=["memory", "coordinator", "prefixed-coordinator"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield InMemoryStore()
        return
    client: CoordinatorClient = request.getfixturevalue("client")
    node = client.register_node("h").node_id
    gen = client.join("contract", node, 1, 1, 1, timeout=5.0).generation
    s: Store = client.store("contract", gen)
    yield PrefixStore("group0", s) if request.param == "prefixed-coordinator" else s


def test_store_contract_set_get_try_get(store: Store) -> None:
    assert store.try_get("k") is None
    store.set("k", b"\x00v")
    assert store.get("k", timeout=1.0) == b"\x00v" and store.try_get("k") == b"\x00v"
    store.set("k", b"w")
    assert store.try_get("k") == b"w"
    with pytest.raises(StoreTimeout):
        store.get("missing", timeout=0.1)


def test_store_contract_add_compare_set_delete(store: Store) -> None:
    assert store.add("n", 2) == 2 and store.add("n", -5) == -3
    assert store.compare_set("c", None, b"a") == (True, b"a")
    assert store.compare_set("c", b"x", b"b") == (False, b"a")
    assert store.compare_set("c", b"a", b"b") == (True, b"b")
    assert store.delete("c") is True and store.delete("c") is False
    store.set("text", b"abc")
    with pytest.raises(StoreError, match="not an integer"):
        store.add("text", 1)


def test_store_contract_wait_and_barrier(store: Store) -> None:
    setter = threading.Timer(0.1, store.set, args=("late", b"1"))
    setter.start()
    try:
        store.wait(["late"], timeout=5.0)
    finally:
        setter.cancel()
    with pytest.raises(StoreTimeout):
        store.wait(["late", "never"], timeout=0.1)
    threads = [threading.Thread(target=store.barrier, args=("b0", 3, 5.0)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(StoreTimeout):
        store.barrier("b1", 2, 0.1)


def test_store_contract_limits(store: Store) -> None:
    with pytest.raises(StoreError):
        store.set("big", bytes(MAX_VALUE_BYTES + 1))
    unprefixed = store.base if isinstance(store, PrefixStore) else store
    with pytest.raises(StoreError, match="non-empty"):
        unprefixed.set("", b"x")
