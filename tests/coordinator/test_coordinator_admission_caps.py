"""Capacity only the authenticated can hold, shared out per client address (coordinator/service/admission.py).

Real coordinators listening on both loopback families: the flood comes from 127.0.0.1 over many connections, and
the calls that must still be served from ::1, a client address of its own. Every bound asserted is a configured
limit; waits use generous deadlines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import RunningCoordinator
from axond.testing.waits import wait_until
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

TOKEN = "t"
AUTH = [("authorization", f"Bearer {TOKEN}")]
OWN = [("grpc.use_local_subchannel_pool", 1)]
DEADLINE = 30.0


def _dual_stack(coordinator_factory: Callable[..., RunningCoordinator], limits: CoordinatorLimits
                ) -> tuple[RunningCoordinator, str, str]:
    """A coordinator on `::` and its two loopback addresses (IPv4 and IPv6: two client addresses)."""
    try:
        running = coordinator_factory(host="::", token=TOKEN, limits=limits)
    except Exception as e:  # noqa: BLE001 - no IPv6 here: the test cannot make a second client address
        pytest.skip(f"cannot listen on [::] ({e})")
    return running, f"127.0.0.1:{running.port}", f"[::1]:{running.port}"


def _ended(calls: list[grpc.Call]) -> dict[grpc.StatusCode, int]:
    """Status codes of the calls that ended (reading response streams, whose status arrives only while read)."""
    codes: dict[grpc.StatusCode, int] = {}
    for c in calls:
        if c.done():
            code = c.code()
            codes[code] = codes.get(code, 0) + 1
    return codes


def _drain(call: grpc.Call) -> None:
    try:
        for _ in call:  # type: ignore[attr-defined]
            pass
    except grpc.RpcError:
        pass


def test_strangers_get_the_health_check_and_nothing_that_holds_a_slot(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(token=TOKEN)
    admission = running.admission
    assert admission is not None
    channels = [grpc.insecure_channel(running.address, options=OWN) for _ in range(4)]
    try:
        watches = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
                   for ch in channels for _ in range(50)]
        for w in watches:
            _drain(w)
        assert {w.code() for w in watches} == {grpc.StatusCode.UNAUTHENTICATED}
        assert admission.running == [0, 0] and admission.request_bytes == 0
        health = health_pb2_grpc.HealthStub(channels[0])
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:  # a check names one service: a long body is refused undecoded
            health.Check(health_pb2.HealthCheckRequest(service="x" * 4096), timeout=DEADLINE)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reflect = reflection_pb2_grpc.ServerReflectionStub(channels[1])
        answers = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=DEADLINE)
        with pytest.raises(grpc.RpcError) as e:
            list(answers)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token, Watch is served (from the reserved pool, counted while it runs).
        held = health_pb2_grpc.HealthStub(channels[2]).Watch(health_pb2.HealthCheckRequest(), metadata=AUTH,
                                                             timeout=DEADLINE)
        assert next(held).status == health_pb2.HealthCheckResponse.SERVING
        assert admission.running[1] == 1
        held.cancel()
    finally:
        for ch in channels:
            ch.close()


@pytest.mark.timeout(180)
def test_one_address_over_many_connections_holds_at_most_its_share(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    limits = CoordinatorLimits(max_calls_per_client=20, max_calls_per_address=50, max_concurrent_calls=200,
                               max_liveness_calls_per_client=10, max_liveness_calls_per_address=25,
                               max_liveness_calls=100)
    running, v4, v6 = _dual_stack(coordinator_factory, limits)
    admission = running.admission
    assert admission is not None
    connections = 6  # 6 x 20 KV streams and 6 x 10 Watch streams: more than the address's share of each pool
    flood = [grpc.insecure_channel(v4, options=OWN) for _ in range(connections)]
    streams: list[grpc.Call] = []
    stop = threading.Event()
    try:
        for ch in flood:
            kv = pb_grpc.CoordinatorStub(ch)
            streams += [kv.KvStream(_silent(stop), metadata=AUTH, timeout=DEADLINE * 4) for _ in range(20)]
            health = health_pb2_grpc.HealthStub(ch)
            streams += [health.Watch(health_pb2.HealthCheckRequest(), metadata=AUTH, timeout=DEADLINE * 4)
                        for _ in range(10)]
        wanted = connections * 30 - 50 - 25  # every stream past the address's two shares is refused
        wait_until(lambda: sum(_ended(streams).values()) >= wanted, DEADLINE, "the refusals past the shares")
        assert admission.running[0] <= 50 and admission.running[1] <= 25, admission.running
        assert set(_ended(streams)) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        details = {c.details() for c in streams if c.done()}
        assert any("max_calls_per_address" in d for d in details), details
        assert any("max_liveness_calls_per_address" in d for d in details), details

        # Another client address is served at once, by calls that are never retried here: health, status, a new
        # node and its heartbeat, a new job's Join and its KvSet.
        with grpc.insecure_channel(v6) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            t0 = time.monotonic()
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
            stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=DEADLINE)
            node = stub.RegisterNode(pb.RegisterNodeRequest(hostname="new"), metadata=AUTH, timeout=DEADLINE)
            stub.Heartbeat(pb.HeartbeatRequest(node_id=node.node_id, node_secret=node.node_secret), metadata=AUTH,
                           timeout=DEADLINE)
            stub.Join(pb.JoinRequest(job="new", node_id=node.node_id, node_secret=node.node_secret, nproc=1,
                                     min_nodes=1, max_nodes=1, timeout_s=DEADLINE), metadata=AUTH, timeout=DEADLINE)
            stub.KvSet(pb.KvSetRequest(job="new", generation=1, key="k", value=b"v"), metadata=AUTH,
                       timeout=DEADLINE)
            assert time.monotonic() - t0 < DEADLINE
        # The health check holds nothing, so the flooding address itself still gets it.
        health_pb2_grpc.HealthStub(flood[0]).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
    finally:
        stop.set()
        for c in streams:
            c.cancel()
        for ch in flood:
            ch.close()
    wait_until(lambda: admission.running == [0, 0], DEADLINE, "the streams to be counted out")


def _silent(stop: threading.Event) -> Iterator[pb.KvStreamRequest]:
    """A request stream that sends nothing until `stop`."""
    stop.wait(DEADLINE * 4)
    yield from ()


def _padded_get(pad: int) -> bytes:
    """A KvGet that waits, carrying `pad` bytes in an unknown field (kept by the parser, so the request holds them)."""
    body = pb.KvGetRequest(job="j", generation=1, key="never", wait_s=DEADLINE).SerializeToString()
    tag, n, varint = (999 << 3) | 2, pad, b""
    for v in (tag, n):
        out = b""
        while True:
            byte, v = v & 0x7F, v >> 7
            out += bytes([byte | (0x80 if v else 0)])
            if not v:
                break
        varint += out
    return body + varint + b"p" * pad


def test_request_bytes_held_are_capped_per_address_and_overall(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    kib = 1 << 10
    limits = CoordinatorLimits(max_request_bytes_per_address=2048 * kib, max_request_bytes=2560 * kib)
    running, v4, v6 = _dual_stack(coordinator_factory, limits)
    admission = running.admission
    assert admission is not None
    with grpc.insecure_channel(v4) as setup:
        stub = pb_grpc.CoordinatorStub(setup)
        node = stub.RegisterNode(pb.RegisterNodeRequest(hostname="h"), metadata=AUTH, timeout=DEADLINE)
        stub.Join(pb.JoinRequest(job="j", node_id=node.node_id, node_secret=node.node_secret, nproc=1, min_nodes=1,
                                 max_nodes=1, timeout_s=DEADLINE), metadata=AUTH, timeout=DEADLINE)
    body = _padded_get(768 * kib)
    held: list[grpc.Future] = []
    a, b = grpc.insecure_channel(v4, options=OWN), grpc.insecure_channel(v6, options=OWN)
    try:
        get_a, get_b = a.unary_unary("/axond.v1.Coordinator/KvGet"), b.unary_unary("/axond.v1.Coordinator/KvGet")
        for _ in range(2):  # 1.5 MiB held from 127.0.0.1
            held.append(get_a.future(body, metadata=AUTH, timeout=DEADLINE * 2))
        wait_until(lambda: admission.request_bytes >= 2 * len(body), DEADLINE, "two long-polls held")
        with pytest.raises(grpc.RpcError) as e:  # a third would pass the address's 2 MiB
            get_a(body, metadata=AUTH, timeout=DEADLINE)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_request_bytes_per_address" in (e.value.details() or "")
        held.append(get_b.future(body, metadata=AUTH, timeout=DEADLINE * 2))  # 2.25 MiB in all, from ::1
        wait_until(lambda: admission.request_bytes >= 3 * len(body), DEADLINE, "the third long-poll held")
        with pytest.raises(grpc.RpcError) as e:  # another would pass the overall 2.5 MiB: refused undecoded
            get_b(body, metadata=AUTH, timeout=DEADLINE)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_request_bytes" in (e.value.details() or "")
        assert admission.request_bytes == 3 * len(body)
    finally:
        for f in held:
            f.cancel()
        a.close()
        b.close()
    wait_until(lambda: admission.request_bytes == 0 and admission.running == [0, 0], DEADLINE,
               "the long-polls to be counted out")


def _unknown_field(pad: int) -> bytes:
    """`pad` bytes in an unknown field (number 999): the parser keeps them, so the message holds them."""
    out = b""
    for v in ((999 << 3) | 2, pad):
        while True:
            byte, v = v & 0x7F, v >> 7
            out += bytes([byte | (0x80 if v else 0)])
            if not v:
                break
    return out + b"p" * pad


def test_kv_stream_messages_whose_requests_wait_count_until_answered(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    kib = 1 << 10
    limits = CoordinatorLimits(max_request_bytes_per_address=2048 * kib)
    running = coordinator_factory(token=TOKEN, limits=limits)
    admission = running.admission
    assert admission is not None
    with grpc.insecure_channel(running.address) as setup:
        stub = pb_grpc.CoordinatorStub(setup)
        node = stub.RegisterNode(pb.RegisterNodeRequest(hostname="h"), metadata=AUTH, timeout=DEADLINE)
        stub.Join(pb.JoinRequest(job="j", node_id=node.node_id, node_secret=node.node_secret, nproc=1, min_nodes=1,
                                 max_nodes=1, timeout_s=DEADLINE), metadata=AUTH, timeout=DEADLINE)

    def waiting(op_id: int, pad: int) -> bytes:
        op = pb.KvOp(id=op_id, get=pb.KvGetRequest(job="j", generation=1, key="never", wait_s=DEADLINE))
        return pb.KvStreamRequest(ops=[op]).SerializeToString() + _unknown_field(pad)

    stop = threading.Event()
    first = waiting(1, 1536 * kib)  # 1.5 MiB held while its get waits
    second = waiting(2, 1024 * kib)  # would make 2.5 MiB: its get is answered RESOURCE_EXHAUSTED
    quick = pb.KvStreamRequest(ops=[pb.KvOp(id=3, set=pb.KvSetRequest(job="j", generation=1, key="k", value=b"v"))])

    def requests() -> Iterator[bytes]:
        yield first
        wait_until(lambda: admission.request_bytes >= len(first), DEADLINE, "the first message held")
        yield second
        yield quick.SerializeToString()  # nothing waits: counted nowhere, answered
        stop.wait(DEADLINE)

    with grpc.insecure_channel(running.address, options=OWN) as ch:
        call = ch.stream_stream("/axond.v1.Coordinator/KvStream", response_deserializer=pb.KvStreamResponse.FromString)
        answers = call(requests(), metadata=AUTH, timeout=DEADLINE * 2)
        results: dict[int, pb.KvResult] = {}
        try:
            for message in answers:
                results.update((r.id, r) for r in message.results)
                if {2, 3} <= set(results):
                    break
            assert results[2].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], results[2]
            assert "max_request_bytes_per_address" in results[2].message
            assert results[3].code == 0, results[3]
            assert 1 not in results  # still waiting, its message still counted
            assert len(first) - 64 <= admission.request_bytes <= len(first) + 64
        finally:
            stop.set()
            answers.cancel()
    wait_until(lambda: admission.request_bytes == 0 and admission.running == [0, 0], DEADLINE,
               "the stream's bytes to be counted out")
