"""`TCPStore` over real loopback sockets: what only it has (pooled connections, auth, frame and connection limits,
a server that starts late or dies); the Store contract it keeps with every store is
tests/init/test_store_contract.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from axond.store.tcp import TCPStore
from axond.store.tcp_server import MAX_FRAME
from axond.errors import StoreError
from axond.store.base import MAX_KEY_CHARS


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore("127.0.0.1", 0, is_server=True, timeout=5.0)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def client(server: TCPStore) -> Iterator[TCPStore]:
    c = TCPStore("127.0.0.1", server.port, timeout=5.0)
    try:
        yield c
    finally:
        c.close()


def test_a_blocked_wait_does_not_block_other_calls_of_the_same_client(server: TCPStore, client: TCPStore) -> None:
    """Each in-flight call holds its own connection: a thread can set what another thread of the process waits for."""
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(client.get("flag", 5.0)))
    waiter.start()
    time.sleep(0.1)
    client.set("flag", b"up")
    waiter.join(5.0)
    assert got == [b"up"]


def test_barrier_over_the_store(server: TCPStore) -> None:
    clients = [TCPStore("127.0.0.1", server.port, timeout=5.0) for _ in range(3)]
    try:
        threads = [threading.Thread(target=c.barrier, args=("b1", 4, 5.0)) for c in clients]
        for t in threads:
            t.start()
        server.barrier("b1", 4, 5.0)
        for t in threads:
            t.join(5.0)
        assert not any(t.is_alive() for t in threads)
    finally:
        for c in clients:
            c.close()


def test_client_waits_for_a_server_that_starts_later() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    holder: list[TCPStore] = []
    timer = threading.Timer(0.3, lambda: holder.append(TCPStore("127.0.0.1", port, is_server=True)))
    timer.start()
    client = TCPStore("127.0.0.1", port, timeout=5.0)
    try:
        timer.join(5.0)
        client.set("k", b"v")
        assert holder[0].get("k", 1.0) == b"v"
    finally:
        client.close()
        for h in holder:
            h.close()


def test_no_server_fails_within_the_timeout_saying_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable after 0.5 s.*MASTER_ADDR/MASTER_PORT"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - t0 < 3.0


def test_a_dead_server_fails_calls_and_blocked_waits_at_once(server: TCPStore) -> None:
    client = TCPStore("127.0.0.1", server.port, timeout=1.0)  # also how long a reconnect is tried
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.get("never", 30.0)
        except BaseException as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    server.close()
    waiter.join(5.0)
    assert time.monotonic() - t0 < 3.0
    assert len(errors) == 1 and isinstance(errors[0], StoreError) and "rank 0" in str(errors[0])
    with pytest.raises(StoreError):
        client.set("k", b"v")
    client.close()


def test_job_secrets_authenticate_both_ends() -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, secret=b"s" * 16)
    try:
        good = TCPStore("127.0.0.1", server.port, timeout=2.0, secret=b"s" * 16)
        good.set("k", b"v")
        assert server.get("k", 1.0) == b"v"
        good.close()
        with pytest.raises(StoreError, match="authentication failed"):
            TCPStore("127.0.0.1", server.port, timeout=2.0, secret=b"t" * 16)
        with pytest.raises(StoreError, match="AXOND_JOB_SECRET alike"):
            TCPStore("127.0.0.1", server.port, timeout=2.0)
    finally:
        server.close()


def test_oversized_frames_and_strangers_are_refused(server: TCPStore, client: TCPStore) -> None:
    with pytest.raises(StoreError, match="limit"):
        client.set("huge", b"x" * (MAX_FRAME + 1))
    with pytest.raises(StoreError, match=f"the limit is {MAX_KEY_CHARS}"):
        client.set("k" * 5000, b"v")
    with socket.create_connection(("127.0.0.1", server.port), timeout=2.0) as raw:
        raw.settimeout(2.0)
        raw.recv(4096)  # the greeting
        raw.sendall(struct.pack("!I", MAX_FRAME + 1))
        reply = raw.recv(4096)
        assert b"over the" in reply
    client.set("still", b"fine")
    assert client.get("still", 1.0) == b"fine"
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def greet() -> None:
            conn, _ = other.accept()
            conn.sendall(struct.pack("!I", 5) + b"\x00hell")
            time.sleep(0.5)
            conn.close()

        threading.Thread(target=greet, daemon=True).start()
        with pytest.raises(StoreError, match="not an axond TCP store|malformed"):
            TCPStore("127.0.0.1", port, timeout=2.0)


def test_connections_beyond_the_limit_are_told_so() -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True, max_connections=1)
    try:
        first = TCPStore("127.0.0.1", server.port, timeout=2.0)
        with pytest.raises(StoreError, match="holds 1 connections already"):
            TCPStore("127.0.0.1", server.port, timeout=2.0)
        first.close()
    finally:
        server.close()


def test_the_server_lingers_until_its_clients_left() -> None:
    server = TCPStore("127.0.0.1", 0, is_server=True)
    client = TCPStore("127.0.0.1", server.port, timeout=2.0)
    threading.Timer(0.3, client.close).start()
    t0 = time.monotonic()
    server.close(linger=5.0)
    assert 0.2 < time.monotonic() - t0 < 3.0
    lone = TCPStore("127.0.0.1", 0, is_server=True)
    t0 = time.monotonic()
    lone.close(linger=5.0)  # nobody connected: no wait
    assert time.monotonic() - t0 < 1.0
