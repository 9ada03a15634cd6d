"""Secure by default: a generated token, node secrets, mutual TLS, and every finding of the security probe.

Each test drives a real coordinator on loopback through raw stubs, as an attacker on the network would.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from axond.control.client import CoordinatorClient, connect
from axond.control.credentials import resolve_token
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError, StoreError
from axond.testing.waits import wait_until
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

C = grpc.StatusCode


@pytest.fixture
def raw() -> Iterator[Callable[[RunningCoordinator], pb_grpc.CoordinatorStub]]:
    """Stubs on plain channels that send no token (a stranger on the network)."""
    channels: list[grpc.Channel] = []

    def make(running: RunningCoordinator) -> pb_grpc.CoordinatorStub:
        channels.append(grpc.insecure_channel(running.address))
        return pb_grpc.CoordinatorStub(channels[-1])

    yield make
    for ch in channels:
        ch.close()


def code(call: Callable[..., object], request: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, timeout=10.0, **kwargs)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""  # type: ignore[attr-defined]
    return C.OK, ""


def test_token_is_generated_private_and_reused(coordinator_factory: Callable[..., RunningCoordinator],
                                               tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = coordinator_factory(state_dir=str(state))
    assert first.token and first.token_path == state / "token"
    assert stat.S_IMODE(os.stat(first.token_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    second = coordinator_factory(state_dir=str(state))
    assert second.token == first.token, "a restart with the same state dir keeps the token"
    with connect(second.address, token_file=str(first.token_path), call_timeout=5.0) as c:
        c.get_status()


def test_stranger_without_token_can_do_nothing(coordinator: RunningCoordinator, client: CoordinatorClient,
                                               raw: Callable[[RunningCoordinator], pb_grpc.CoordinatorStub]) -> None:
    assert coordinator.token, "no security flags: a token is required anyway"
    node = client.register_node("h").node_id
    client.join("j", node, 1, 1, 1, timeout=5.0)
    client.store("j", 1).set("secret-key", b"v")
    s = raw(coordinator)
    for call, request in [
        (s.SubmitJob, pb.SubmitJobRequest(nnodes=1, nproc_per_node=1, argv=["touch", "/tmp/pwned"])),
        (s.KvGet, pb.KvGetRequest(job="j", generation=1, key="secret-key")),
        (s.ReportFailure, pb.ReportFailureRequest(job="j", node_id=node, generation=1, rank=0)),
        (s.RegisterNode, pb.RegisterNodeRequest(hostname="!evil")),
        (s.Join, pb.JoinRequest(job="j", node_id=node, nproc=1, min_nodes=1, max_nodes=1, timeout_s=1)),
        (s.GetStatus, pb.GetStatusRequest()),
    ]:
        assert code(call, request)[0] == C.UNAUTHENTICATED, type(request).__name__
    wrong = [("authorization", "Bearer " + "x" * len(coordinator.token or ""))]
    assert code(s.GetStatus, pb.GetStatusRequest(), metadata=wrong)[0] == C.UNAUTHENTICATED


def test_same_machine_clients_find_the_token_other_hosts_never_get_it(coordinator: RunningCoordinator) -> None:
    assert resolve_token(coordinator.address) == coordinator.token
    assert resolve_token("10.1.2.3:29500") is None, "the local token must never go to another machine"
    assert resolve_token("10.1.2.3:29500", token="given") == "given"
    with connect(coordinator.address, call_timeout=5.0) as c:
        c.get_status()


def test_node_ids_are_not_credentials(client: CoordinatorClient, coordinator: RunningCoordinator) -> None:
    victim = client.register_node("victim").node_id
    client.join("j", victim, 1, 1, 1, max_restarts=3, timeout=5.0)
    with connect(coordinator.address, call_timeout=5.0) as other:
        other.register_node("attacker")
        s = other.stub
        for secret in ("", other.node_secret(next(iter(other._node_secrets))), "0" * 32):
            req = pb.ReportFailureRequest(job="j", node_id=victim, generation=1, rank=0, node_secret=secret)
            assert code(s.ReportFailure, req)[0] == C.PERMISSION_DENIED
            assert code(s.Heartbeat, pb.HeartbeatRequest(node_id=victim, node_secret=secret))[0] == C.PERMISSION_DENIED
            assert code(s.DeregisterNode, pb.DeregisterNodeRequest(node_id=victim, node_secret=secret))[0] == C.PERMISSION_DENIED
    status = client.get_status("j")
    assert status.jobs[0].generation == 1 and status.jobs[0].restarts == 0, "nothing restarted the job"


def test_output_only_from_the_jobs_own_nodes(client: CoordinatorClient) -> None:
    daemon = client.register_node("d", slots=1, daemon=True).node_id
    job = client.submit_job(["true"], 1, 1)
    assert [a.job for a in client.poll_work(daemon, 5.0).assignments] == [job]
    client.push_output(job, daemon, [pb.OutputLine(rank=0, stream="stdout", text="mine")])
    other = client.register_node("o", slots=1, daemon=True).node_id
    with pytest.raises(CoordinatorError, match="PERMISSION_DENIED.*does not run job"):
        client.push_output(job, other, [pb.OutputLine(rank=0, stream="stdout", text="forged")])


def test_huge_nproc_and_world_size_are_refused_fast(client: CoordinatorClient) -> None:
    node = client.register_node("h").node_id
    s, secret = client.stub, client.node_secret(node)
    t0 = time.monotonic()
    req = pb.JoinRequest(job="big", node_id=node, nproc=2**32 - 1, min_nodes=1, max_nodes=1, timeout_s=1,
                         node_secret=secret)
    got, detail = code(s.Join, req)
    assert got == C.INVALID_ARGUMENT and "max_nproc_per_node" in detail
    other = client.register_node("h2").node_id
    for n, ask in ((node, 2**31), (other, 2**31)):
        req = pb.JoinRequest(job="big2", node_id=n, nproc=ask, min_nodes=2, max_nodes=2, timeout_s=1,
                             node_secret=client.node_secret(n))
        assert code(s.Join, req)[0] == C.INVALID_ARGUMENT
    client.get_status()
    assert time.monotonic() - t0 < 5.0


def test_status_of_a_large_job_is_bounded(client: CoordinatorClient) -> None:
    nodes = [client.register_node(f"h{i}").node_id for i in range(4)]
    import threading

    threads = [threading.Thread(target=client.join, args=("wide", n, 1024, 4, 4), kwargs={"timeout": 10.0})
               for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15.0)
    job = client.get_status("wide").jobs[0]
    assert job.world_size == 4096 and len(job.ranks) == 1024 and job.ranks_omitted == 3072
    job = client.get_status("wide", max_ranks=10).jobs[0]
    assert [r.rank for r in job.ranks] == list(range(10)) and job.ranks[0].hostname == "h0"


def test_kv_add_overflow_is_out_of_range_and_changes_nothing(client: CoordinatorClient) -> None:
    node = client.register_node("h").node_id
    client.join("j", node, 1, 1, 1, timeout=5.0)
    s = client.stub
    assert client.store("j", 1).add("c", 2**63 - 2) == 2**63 - 2
    got, detail = code(s.KvAdd, pb.KvAddRequest(job="j", generation=1, key="c", delta=5))
    assert got == C.OUT_OF_RANGE and "unchanged" in detail
    assert client.store("j", 1).add("c", 0) == 2**63 - 2


def test_undecodable_bodies_and_huge_names_are_invalid_argument(coordinator: RunningCoordinator) -> None:
    auth = [("authorization", f"Bearer {coordinator.token}")]
    with grpc.insecure_channel(coordinator.address) as ch:
        for method in ("KvGet", "Join", "SubmitJob", "GetStatus", "StreamJob"):
            path = f"/axond.v1.Coordinator/{method}"
            call = ch.unary_stream(path) if method == "StreamJob" else ch.unary_unary(path)
            for body in (b"\xff\xff\xff\xff", b"\x0a\x05\xff\xfe\xfd\xfc\xfb"):
                try:
                    result = call(body, timeout=5.0, metadata=auth)
                    if method == "StreamJob":
                        list(result)  # type: ignore[call-overload]
                    got = C.OK
                except grpc.RpcError as e:
                    got = e.code()  # type: ignore[attr-defined]
                assert got == C.INVALID_ARGUMENT, (method, body, got)
        stub = pb_grpc.CoordinatorStub(ch)
        for request, call in ((pb.KvGetRequest(job="x" * (1 << 20), generation=1, key="k"), stub.KvGet),
                              (pb.CancelJobRequest(job="y" * (1 << 20)), stub.CancelJob),
                              (pb.SubmitJobRequest(job="z" * (1 << 20), nnodes=1, nproc_per_node=1, argv=["a"]),
                               stub.SubmitJob)):
            got, detail = code(call, request, metadata=auth)
            assert got in (C.INVALID_ARGUMENT, C.NOT_FOUND) and len(detail) < 2100, (got, len(detail))


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_memory_a_caller_can_grow_is_bounded(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    limits = CoordinatorLimits(max_jobs=4, max_queued_jobs=2, max_store_bytes_per_job=8192,
                               max_output_bytes_per_job=4096, max_command_bytes=1024)
    running = coordinator_factory(limits=limits)
    with connect(running.address, call_timeout=5.0) as c:
        node = c.register_node("h").node_id
        c.join("j", node, 1, 1, 1, timeout=5.0)
        s = c.stub
        got = C.OK
        for i in range(200):  # barrier arrival ids count against the store budget
            req = pb.BarrierRequest(job="j", generation=1, name="b", world_size=10**6, arrival_id=f"{i:08d}" * 8)
            got, detail = _arrive(s, req)
            if got != C.DEADLINE_EXCEEDED:
                break
        assert got == C.RESOURCE_EXHAUSTED and "max_store_bytes_per_job" in detail
        big = ["x" * 600, "y" * 600]
        assert code(s.SubmitJob, pb.SubmitJobRequest(nnodes=1, nproc_per_node=1, argv=big))[0] == C.INVALID_ARGUMENT
        c.submit_job(["a"], 1, 1)
        c.submit_job(["b"], 1, 1)
        got, detail = code(s.SubmitJob, pb.SubmitJobRequest(nnodes=1, nproc_per_node=1, argv=["c"]))
        assert got == C.RESOURCE_EXHAUSTED and "max_queued_jobs" in detail
        other = c.register_node("h2").node_id
        c.join("k", other, 1, 1, 1, timeout=5.0)  # the 4th job
        got, detail = code(s.Join, pb.JoinRequest(job="l", node_id=other, nproc=1, min_nodes=1, max_nodes=1,
                                                  timeout_s=1, node_secret=c.node_secret(other)))
        assert got == C.RESOURCE_EXHAUSTED and "max_jobs" in detail
        c.report_exit("k", other, 1, 0)  # finished jobs make room
        assert c.join("l", other, 1, 1, 1, timeout=5.0).generation == 1
        c.cancel_job("job-1")
        c.cancel_job("job-2")
        job = c.submit_job(["q"], 1, 1)
        d = c.register_node("d", slots=1, daemon=True).node_id
        for _ in range(40):
            if any(a.job == job for a in c.poll_work(d, 1.0).assignments):
                break
        for i in range(50):
            c.push_output(job, d, [pb.OutputLine(rank=0, stream="stdout", text=f"{i:04d}" + "o" * 400)])
        c.cancel_job(job)
        events = list(c.stream_job(job, timeout=5.0))
        text = [e.output.text for e in events if e.HasField("output")]
        assert sum(len(t) for t in text) <= 4096 and text[-1].startswith("0049")
        assert any("dropped" in e.info and "max_output_bytes_per_job" in e.info for e in events if e.HasField("info"))


def _arrive(stub: pb_grpc.CoordinatorStub, request: pb.BarrierRequest) -> tuple[grpc.StatusCode, str]:
    request.wait_s = 0.05
    return code(stub.Barrier, request)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_insecure_needs_the_flag_and_warns(tmp_path: Path) -> None:
    env = {**os.environ, "AXOND_STATE_DIR": str(tmp_path / "s")}
    proc = subprocess.Popen([sys.executable, "-c", "from axond.cli.main import main; main()", "coordinator",
                             "--port", "0", "--host",
                             "127.0.0.1", "--insecure"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.stderr is not None:
            line = proc.stderr.readline()
            lines.append(line)
            if "WARNING" in line or not line:
                break
        assert any("NO TOKEN" in x for x in lines) and any("WARNING: --insecure" in x for x in lines), lines
        assert not (tmp_path / "s" / "token").exists()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def mtls_files(tmp_path: Path) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    f = {k: str(tmp_path / f"{k}.pem") for k in ("ca", "ca_key", "srv", "srv_key", "cli", "cli_key", "csr")}
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=axond-test-ca",
        "-keyout", f["ca_key"], "-out", f["ca"])
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for who, cn in (("srv", "localhost"), ("cli", "worker")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f[f"{who}_key"], "-out", f["csr"])
        run("x509", "-req", "-in", f["csr"], "-CA", f["ca"], "-CAkey", f["ca_key"], "-CAcreateserial", "-days", "1",
            "-extfile", str(ext), "-out", f[who])
    return f


def test_mutual_tls_requires_a_client_certificate(coordinator_factory: Callable[..., RunningCoordinator],
                                                  mtls_files: dict[str, str]) -> None:
    f = mtls_files
    running = coordinator_factory(tls_cert=f["srv"], tls_key=f["srv_key"], tls_client_ca=f["ca"], token="t")
    with connect(running.address, token="t", tls_ca=f["ca"], tls_cert=f["cli"], tls_key=f["cli_key"],
                 call_timeout=5.0) as c:
        c.get_status()
    with connect(running.address, token="t", tls_ca=f["ca"], call_timeout=3.0) as anonymous:
        with pytest.raises(CoordinatorError, match="UNAVAILABLE"):
            anonymous.get_status()
    with pytest.raises(CoordinatorError, match="needs --tls-ca"):
        connect(running.address, tls_cert=f["cli"], tls_key=f["cli_key"])


def test_limits_table_in_the_docs_matches_the_options() -> None:
    from dataclasses import fields

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
            for line in page.splitlines() if line.startswith("| `")}
    defaults = CoordinatorLimits()
    assert set(rows) == {f.name for f in fields(defaults)}
    for f in fields(defaults):
        assert rows[f.name] == f"{getattr(defaults, f.name):,}", f.name


def test_limits_are_set_from_the_command_line() -> None:
    import click

    from axond.cli.coordinator_cmd import parse_limits

    assert parse_limits(("max_jobs=5", "status_retention_s=2.5")) == CoordinatorLimits(max_jobs=5, status_retention_s=2.5)
    for bad in ("max_jobs", "nope=1", "max_jobs=x", "max_jobs=0"):
        with pytest.raises(click.UsageError):
            parse_limits((bad,))


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_a_full_coordinator_turns_calls_away_at_once_and_clients_retry(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(limits=CoordinatorLimits(max_concurrent_calls=4))
    import threading

    with connect(running.address, call_timeout=10.0) as c:
        node = c.register_node("h").node_id
        c.join("j", node, 1, 1, 1, timeout=5.0)
        expired: list[BaseException] = []

        park_s = 1.5

        def park() -> None:
            store = c.store("j", 1)  # a store each: each long-poll holds a call (one KV stream per store)
            try:
                store.get("never-set", timeout=park_s)
            except StoreError as e:
                expired.append(e)
            finally:
                store.close()

        waiters = [threading.Thread(target=park) for _ in range(4)]
        for t in waiters:
            t.start()
        admission = running.admission
        assert admission is not None
        wait_until(lambda: admission.running[0] >= 4, park_s, "the four long-polls to fill the coordinator")
        with grpc.insecure_channel(running.address) as ch:
            auth = [("authorization", f"Bearer {running.token}")]
            stub = pb_grpc.CoordinatorStub(ch)
            t0 = time.monotonic()
            got, detail = code(stub.KvSet, pb.KvSetRequest(job="j", generation=1, key="k", value=b"v"), metadata=auth)
            # Turned away at once: a call that waited for a slot would be served once the long-polls end.
            assert got == C.RESOURCE_EXHAUSTED and time.monotonic() - t0 < park_s, (got, detail)
            # Status (like health and heartbeats) is served from a reserved pool: a full coordinator still answers it.
            got, detail = code(stub.GetStatus, pb.GetStatusRequest(), metadata=auth)
            assert got == C.OK and time.monotonic() - t0 < park_s, (got, detail)
        store = c.store("j", 1)
        store.set("k", b"v")  # turned away until the long-polls end, then served within its deadline
        assert store.get("k", timeout=0) == b"v"
        store.close()
        for t in waiters:
            t.join(20.0)
        assert len(expired) == 4
