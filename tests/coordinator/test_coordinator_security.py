"""Token checks, TLS with a self-signed certificate, the health service and reflection."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError, StoreError
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc


def test_wrong_or_missing_token_is_unauthenticated(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(token="s3cret")
    with connect(running.address, token="s3cret", call_timeout=5.0) as good:
        node = good.register_node("h").node_id
        good.join("j", node, 1, 1, 1, timeout=5.0)
        good.store("j", 1).set("k", b"v")
        assert good.health()
    for token in (None, "wrong", "s3cret-but-longer"):
        with connect(running.address, token=token, call_timeout=5.0) as bad:
            with pytest.raises(CoordinatorError, match="UNAUTHENTICATED.*--token"):
                bad.get_status()
            with pytest.raises(StoreError, match="UNAUTHENTICATED"):
                bad.store("j", 1).get("k", timeout=1.0)
            with pytest.raises(CoordinatorError, match="UNAUTHENTICATED"):
                list(bad.stream_job("j", timeout=2.0))
            assert bad.health(), "the health check is exempt from the token (probes)"
    channel = grpc.insecure_channel(running.address)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStatus(pb.GetStatusRequest(), timeout=5.0, metadata=[("authorization", "s3cret")])
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5.0))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    finally:
        channel.close()


def test_health_and_reflection_answer(coordinator: RunningCoordinator) -> None:
    channel = grpc.insecure_channel(coordinator.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "axond.v1.Coordinator"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        auth = [("authorization", f"Bearer {coordinator.token}")]
        (resp,) = list(refl.ServerReflectionInfo(iter([request]), timeout=5.0, metadata=auth))
        names = {s.name for s in resp.list_services_response.service}
        assert {"axond.v1.Coordinator", "grpc.health.v1.Health"} <= names
    finally:
        channel.close()


def test_health_is_false_when_nothing_listens(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory()
    address = running.address
    running.stop(grace=0.1)
    assert running.wait(5.0)
    with connect(address, call_timeout=1.0) as c:
        assert not c.health(timeout=1.0)
        with pytest.raises(CoordinatorError, match="UNAVAILABLE.*running and reachable"):
            c.get_status()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return str(cert), str(key)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_tls_with_token(coordinator_factory: Callable[..., RunningCoordinator], tls_files: tuple[str, str]) -> None:
    cert, key = tls_files
    running = coordinator_factory(tls_cert=cert, tls_key=key, token="t")
    with connect(running.address, token="t", tls_ca=cert, call_timeout=5.0) as c:
        assert c.health()
        node = c.register_node("h").node_id
        assert c.join("j", node, 2, 1, 1, timeout=5.0).world_size == 2
    with connect(running.address, token="t", call_timeout=2.0) as plain:
        assert not plain.health(timeout=2.0)
        with pytest.raises(CoordinatorError, match="UNAVAILABLE"):
            plain.get_status()
    with pytest.raises(CoordinatorError, match="TLS CA file"):
        connect(running.address, tls_ca="/nonexistent/ca.pem")


def test_bad_tls_config_is_refused(coordinator_factory: Callable[..., RunningCoordinator], tmp_path: Path) -> None:
    with pytest.raises(CoordinatorError, match="both --tls-cert and --tls-key"):
        coordinator_factory(tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(CoordinatorError, match="cannot read the TLS"):
        coordinator_factory(tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
