"""Control connections over a slow link: a proxy adds 250 ms each way between clients and a real coordinator.

The handshake of a gRPC connection takes whole round trips, so every connection attempt must be allowed
the connect timeout (not the reconnect backoff), and a connection attempt that fails is retried within it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from axond.control.channel import DEFAULT_CONNECT_TIMEOUT_S, channel_options
from axond.control.client import CoordinatorClient, connect
from axond.control.sniff import speaks_tls
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError
from latency_proxy import DelayProxy
from worker_support import FAST, Procs, coord, free_port, procs, self_signed  # noqa: F401

pytestmark = pytest.mark.slow  # real workers behind a 250 ms proxy

DELAY_S = 0.25
"""Added each way: a 500 ms round trip, five times what a 100 ms connect timeout allows."""


@pytest.fixture
def slow_link(coord: RunningCoordinator) -> Iterator[DelayProxy]:
    host, port = coord.address.rsplit(":", 1)
    proxy = DelayProxy((host, int(port)), DELAY_S)
    try:
        yield proxy
    finally:
        proxy.close()


def test_the_connect_timeout_bounds_each_connection_attempt() -> None:
    options = dict(channel_options(12.5))
    assert options["grpc.min_reconnect_backoff_ms"] == 12_500  # gRPC's minimum connect timeout
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000  # reconnects stay quick
    assert dict(channel_options())["grpc.min_reconnect_backoff_ms"] == int(DEFAULT_CONNECT_TIMEOUT_S * 1000)
    with connect("127.0.0.1:1", connect_wait=7.0) as waiting, connect("127.0.0.1:1") as plain:
        assert waiting.connect_timeout == 7.0
        assert plain.connect_timeout == DEFAULT_CONNECT_TIMEOUT_S


def test_health_answers_through_the_slow_link(slow_link: DelayProxy, procs: Procs) -> None:
    res = procs.run("health", "--coordinator", slow_link.address, timeout=30)
    assert res.code == 0, res.stderr
    assert "is serving" in res.stdout + res.stderr


def test_a_connection_cut_during_the_handshake_is_retried(
    coordinator_factory: Callable[..., RunningCoordinator],
) -> None:
    """Until the coordinator listens, the proxy accepts and drops each connection (a reset handshake, not a
    refusal); the first call keeps trying within the connect wait and gets through once it listens."""
    port = free_port()
    proxy = DelayProxy(("127.0.0.1", port), DELAY_S)
    client: CoordinatorClient = connect(proxy.address, call_timeout=10.0, connect_wait=30.0)
    got: list[object] = []
    caller = threading.Thread(target=lambda: got.append(_register_or_error(client)), daemon=True)
    try:
        caller.start()
        assert proxy.wait_for_dropped(3, timeout=20), "the client did not try again after a dropped handshake"
        assert caller.is_alive(), f"the first call gave up within its connect wait: {got}"
        coordinator_factory(port=port, **FAST)
        caller.join(timeout=30)
        assert not caller.is_alive(), "the first call did not end within its connect wait"
        assert got and not isinstance(got[0], Exception), got
    finally:
        client.close()
        proxy.close()


def _register_or_error(client: CoordinatorClient) -> object:
    try:
        return client.register_node("slow-host")  # not retried on UNAVAILABLE once it may have run
    except Exception as e:  # noqa: BLE001 - handed to the test thread
        return e


def test_two_nodes_join_and_train_through_the_slow_link(slow_link: DelayProxy, procs: Procs) -> None:
    """Both workers, and their ranks' KV traffic, talk to the coordinator through the proxy; the data plane
    between ranks stays direct (loopback)."""
    args = ["worker", "--coordinator", slow_link.address, "--job", "slow", "--nnodes", "2", "--nproc-per-node", "1",
            "--stop-grace", "2", "--connect-timeout", "20", "--",
            sys.executable, "-m", "axond.examples.train_mlp", "--epochs", "2", "--samples", "512", "--hidden", "32",
            "--checkpoint", ""]
    a, b = procs.axond(*args), procs.axond(*args)
    ra, rb = procs.finish(a, timeout=90), procs.finish(b, timeout=90)
    assert ra.code == 0 and rb.code == 0, (ra.stderr, rb.stderr)
    out = ra.stdout + rb.stdout
    assert "training on 2 rank(s)" in out, out
    assert "epoch 2" in out.lower() or "loss" in out.lower(), out
    assert slow_link.connections >= 4, "the workers and their ranks all went through the proxy"


def test_a_plaintext_client_of_a_tls_coordinator_is_told_at_once(
    coordinator_factory: Callable[..., RunningCoordinator], tmp_path: Path,
) -> None:
    """A TLS server closing on a plaintext client looks like a dropped connection; it is not waited for."""
    cert, key = self_signed(tmp_path)
    tls = coordinator_factory(tls_cert=cert, tls_key=key, token="t0k")
    plain = coordinator_factory(token="t0k")
    assert speaks_tls(tls.address, 5.0) and not speaks_tls(plain.address, 5.0)
    dropping = DelayProxy(("127.0.0.1", free_port()), DELAY_S)
    try:
        assert not speaks_tls(dropping.address, 5.0)
    finally:
        dropping.close()
    notices: list[str] = []
    with connect(tls.address, token="t0k", connect_wait=30.0, on_wait=notices.append) as client:
        with pytest.raises(CoordinatorError, match="--tls-ca"):
            client.get_status()
    assert notices == [], "no wait for a coordinator that answered (with TLS)"
