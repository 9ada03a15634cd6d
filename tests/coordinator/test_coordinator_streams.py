"""KvStream and HeartbeatStream against a real coordinator on loopback (real gRPC, no mocks)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from axond.control.client import connect
from axond.store.coordinator import CoordinatorStore
from axond.coordinator.service.kv_stream import MAX_STREAM_REQUESTS
from axond.coordinator.server import CoordinatorConfig, RunningCoordinator, start_coordinator
from axond.coordinator.service.servicer import CoordinatorServicer
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.service.waiting import WaitHub
from axond.errors import StoreError, StoreTimeout
from axond.testing.waits import wait_until
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc
from axond.worker.heartbeat import Heartbeater

C = grpc.StatusCode


def _auth(running: RunningCoordinator) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {running.token}")]


def _job(running: RunningCoordinator, job: str = "j") -> int:
    with connect(running.address, token=running.token, call_timeout=5.0) as c:
        node = c.register_node("h").node_id
        return c.join(job, node, 1, 1, 1, timeout=5.0).generation


def _results(running: RunningCoordinator, *messages: pb.KvStreamRequest, token: bool = True) -> dict[int, pb.KvResult]:
    with grpc.insecure_channel(running.address) as ch:
        replies = pb_grpc.CoordinatorStub(ch).KvStream(iter(messages), metadata=_auth(running) if token else None,
                                                       timeout=10)
        return {r.id: r for reply in replies for r in reply.results}


def test_each_request_is_answered_by_id_with_its_own_status_and_the_stream_stays_open(
        coordinator: RunningCoordinator) -> None:
    gen = _job(coordinator)
    ops = [
        pb.KvOp(id=7, set=pb.KvSetRequest(job="j", generation=gen, key="a", value=b"1")),
        pb.KvOp(id=8, get=pb.KvGetRequest(job="j", generation=gen, key="a")),
        pb.KvOp(id=9, get=pb.KvGetRequest(job="j", generation=gen, key="unset")),
        pb.KvOp(id=10),
        pb.KvOp(id=11, add=pb.KvAddRequest(job="j", generation=gen + 3, key="n", delta=1)),
        pb.KvOp(id=12, get=pb.KvGetRequest(job="j", generation=gen, key="a", wait_s=-1)),
        pb.KvOp(id=13, set=pb.KvSetRequest(job="j", generation=gen, key="k" * 100_000, value=b"")),
        pb.KvOp(id=14, get=pb.KvGetRequest(job="j", generation=gen, key="late", wait_s=0.2)),
        pb.KvOp(id=15, barrier=pb.BarrierRequest(job="j", generation=gen, name="b", world_size=2, participant=5)),
    ]
    later = [
        pb.KvOp(id=16, add=pb.KvAddRequest(job="j", generation=gen, key="n", delta=5)),
        pb.KvOp(id=17, compare_set=pb.KvCompareAndSetRequest(job="j", generation=gen, key="a", expected=b"1",
                                                              desired=b"2")),
        pb.KvOp(id=18, delete=pb.KvDeleteRequest(job="j", generation=gen, key="a")),
        pb.KvOp(id=19, wait=pb.KvWaitRequest(job="j", generation=gen, keys=["n"], wait_s=1.0)),
    ]
    got = _results(coordinator, pb.KvStreamRequest(ops=ops), pb.KvStreamRequest(ops=later))
    assert sorted(got) == list(range(7, 20))
    codes = {i: C.OK if r.code == 0 else next(c for c in C if c.value[0] == r.code) for i, r in got.items()}
    assert codes == {
        7: C.OK, 8: C.OK, 9: C.NOT_FOUND, 10: C.INVALID_ARGUMENT, 11: codes[11], 12: C.INVALID_ARGUMENT,
        13: C.INVALID_ARGUMENT, 14: C.DEADLINE_EXCEEDED, 15: C.INVALID_ARGUMENT, 16: C.OK, 17: C.OK, 18: C.OK, 19: C.OK,
    }
    with grpc.insecure_channel(coordinator.address) as ch:  # the same status as the unary call
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CoordinatorStub(ch).KvAdd(ops[4].add, metadata=_auth(coordinator), timeout=5)
    assert codes[11] == e.value.code() and got[11].message == e.value.details() and "generation" in got[11].message
    assert got[8].get.value == b"1" and got[16].add.value == 5
    assert got[17].compare_set.swapped and got[18].delete.existed
    assert "names no operation" in got[10].message and "wait_s" in got[12].message


def test_a_body_that_does_not_parse_or_a_missing_token_ends_the_stream_with_a_clear_status(
        coordinator: RunningCoordinator) -> None:
    with grpc.insecure_channel(coordinator.address) as ch:
        for method in ("KvStream", "HeartbeatStream"):
            raw = ch.stream_stream(f"/axond.v1.Coordinator/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as e:
                list(raw(iter([b"\xff\xff\xff"]), metadata=_auth(coordinator), timeout=5))
            assert e.value.code() == C.INVALID_ARGUMENT, (method, e.value.details())
            with pytest.raises(grpc.RpcError) as e:
                list(raw(iter([b""]), timeout=5))
            assert e.value.code() == C.UNAUTHENTICATED, method


def test_requests_past_the_in_flight_bound_are_refused_one_by_one(coordinator: RunningCoordinator) -> None:
    gen = _job(coordinator)
    waits = [pb.KvOp(id=i, get=pb.KvGetRequest(job="j", generation=gen, key="never", wait_s=0.3))
             for i in range(MAX_STREAM_REQUESTS + 1)]
    got = _results(coordinator, pb.KvStreamRequest(ops=waits))
    refused = [i for i, r in got.items() if r.code == C.RESOURCE_EXHAUSTED.value[0]]
    assert refused == [MAX_STREAM_REQUESTS] and "in flight" in got[MAX_STREAM_REQUESTS].message
    assert all(r.code == C.DEADLINE_EXCEEDED.value[0] for i, r in got.items() if i != MAX_STREAM_REQUESTS)


def test_a_store_pipelines_concurrent_callers_over_its_stream(coordinator: RunningCoordinator) -> None:
    gen = _job(coordinator)
    with connect(coordinator.address, token=coordinator.token, call_timeout=5.0) as c:
        store = c.store("j", gen)
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for i in range(50):
                    store.add("counter", 1)
                    store.set(f"t{t}/{i}", bytes([i]))
                    assert store.get(f"t{t}/{i}", timeout=1.0) == bytes([i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        assert not errors, errors[0]
        assert store.add("counter", 0) == 400
        assert store.try_get("unset") is None
        with pytest.raises(StoreTimeout):
            store.get("unset", timeout=0.1)
        with pytest.raises(StoreTimeout):
            store.get("unset", timeout=0)
        assert store.compare_set("cas", None, b"x") == (True, b"x")
        store.barrier("all", 1, timeout=2.0)
        store.close()


def test_a_store_of_a_finished_generation_fails_like_the_unary_calls(coordinator: RunningCoordinator) -> None:
    with connect(coordinator.address, token=coordinator.token, call_timeout=5.0) as c:
        node = c.register_node("h").node_id
        gen = c.join("r", node, 1, 1, 1, max_restarts=1, timeout=5.0).generation
        streamed, unary = c.store("r", gen), CoordinatorStore(c, "r", gen, streamed=False)
        streamed.set("k", b"v")
        c.report_failure("r", node, gen, 0, 1, "boom")
        for store in (streamed, unary):
            with pytest.raises(StoreError, match="generation") as e:
                store.set("k", b"v")
            assert not isinstance(e.value, StoreTimeout)
        streamed.close()


DURABLE_INTERVAL, DURABLE_MISSED = 0.2, 25
"""The durable coordinator's heartbeat settings: a 5 s lease, longer than a restart takes on a busy machine (the
lease is what a restart must not outlast; the interval keeps heartbeats frequent)."""
DURABLE_LEASE = DURABLE_INTERVAL * DURABLE_MISSED


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[Callable[[int], RunningCoordinator]]:
    """Start (and restart, on the same port) a durable coordinator in tmp_path."""
    started: list[RunningCoordinator] = []

    def start(port: int = 0) -> RunningCoordinator:
        config = CoordinatorConfig(host="127.0.0.1", port=port, token="t", state_dir=str(tmp_path),
                                   heartbeat_interval=DURABLE_INTERVAL, dead_after_missed=DURABLE_MISSED)
        for _ in range(50):
            try:
                running = start_coordinator(config)
                break
            except Exception:  # noqa: BLE001 - the old server's port may take a moment to free
                time.sleep(0.1)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop(grace=0.2)


def test_store_and_heartbeat_streams_reconnect_after_a_coordinator_restart(
        durable: Callable[[int], RunningCoordinator]) -> None:
    first = durable(0)
    with connect(first.address, token="t", call_timeout=5.0) as c:
        reg = c.register_node("h")
        gen = c.join("j", reg.node_id, 1, 1, 1, timeout=5.0).generation
        hb = Heartbeater(c, reg.node_id, reg.heartbeat_interval_s, lease=DURABLE_LEASE).start()
        try:
            hb.track("j", gen)
            store = c.store("j", gen)
            store.set("before", b"1")
            first.stop(grace=0.2)
            second = durable(first.port)
            restarted = time.monotonic()
            assert store.get("before", timeout=DURABLE_LEASE) == b"1"  # the stream opened again; the value committed
            store.set("after", b"2")
            wait_until(lambda: hb.last_ok > restarted, DURABLE_LEASE, "a heartbeat answered after the restart")
            assert hb.latest("j") is not None and not hb.lease_lost, hb.last_error
            status = c.get_status()
            assert [n.health for n in status.nodes] == [pb.NODE_HEALTH_ALIVE]
            store.close()
        finally:
            hb.stop()
        assert second.state.kv_get("j", gen, "after") == b"2"


def test_a_node_whose_heartbeat_stream_stops_is_declared_dead(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(heartbeat_interval=0.1, dead_after_missed=3)
    with connect(running.address, call_timeout=5.0) as c:
        reg = c.register_node("h")
        lease = reg.heartbeat_interval_s * reg.dead_after_missed
        started = time.monotonic()
        hb = Heartbeater(c, reg.node_id, reg.heartbeat_interval_s).start()
        wait_until(lambda: hb.last_ok > started + 2 * reg.heartbeat_interval_s, 10 * lease + 5,
                   "heartbeats over the stream")
        assert [n.health for n in c.get_status().nodes] == [pb.NODE_HEALTH_ALIVE]
        assert hb._stream is not None and not hb._stream.unsupported and hb.last_error == ""
        hb.stop()
        # Declared dead one lease (0.3 s) after the last heartbeat, at the coordinator's next sweep; the deadline
        # leaves a busy machine room (the test fails only if the node is never declared dead).
        wait_until(lambda: c.get_status(all=True).nodes[0].health == pb.NODE_HEALTH_DEAD, 10 * lease + 5,
                   "the silent node declared dead")


class _OldServicer(CoordinatorServicer):
    """A coordinator from before the streams: both answer UNIMPLEMENTED (the generated base methods)."""

    KvStream = pb_grpc.CoordinatorServicer.KvStream  # type: ignore[assignment]
    HeartbeatStream = pb_grpc.CoordinatorServicer.HeartbeatStream  # type: ignore[assignment]


@pytest.fixture
def old_coordinator() -> Iterator[str]:
    """A coordinator without the streams on a loopback port, served from a loop thread; yields its address."""
    loop = asyncio.new_event_loop()
    ready: list[tuple[grpc.aio.Server, int]] = []

    async def serve() -> None:
        state = CoordinatorState(heartbeat_interval=0.2)
        hub = WaitHub(asyncio.get_running_loop())
        state.listen(hub.notify)
        server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(_OldServicer(state, hub), server)
        ready.append((server, server.add_insecure_port("127.0.0.1:0")))
        await server.start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    server, port = ready[0]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0.2), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_against_a_coordinator_without_the_streams_store_and_heartbeats_use_unary_calls(old_coordinator: str) -> None:
    with connect(old_coordinator, call_timeout=5.0) as c:
        reg = c.register_node("h")
        gen = c.join("j", reg.node_id, 1, 1, 1, timeout=5.0).generation
        store = c.store("j", gen)
        store.set("k", b"v")
        assert store.get("k", timeout=1.0) == b"v" and store.add("n", 2) == 2
        started = time.monotonic()
        hb = Heartbeater(c, reg.node_id, 0.1).start()
        try:
            wait_until(lambda: hb.last_ok > started + 0.2, 10.0, "heartbeats answered as unary calls")
            assert hb._stream is not None and hb._stream.unsupported and hb.last_error == ""
        finally:
            hb.stop()
        store.close()
