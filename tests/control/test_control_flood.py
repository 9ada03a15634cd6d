"""One client's flood cannot take the coordinator from everyone else (coordinator/service/admission.py).

A real coordinator on loopback. One client (one connection) opens CONTROL_FLOOD_STREAMS idle KvStream
streams (default 600; the issue's 3,000 by hand): it holds at most its share (max_calls_per_client), the
rest are refused at once; meanwhile health, status and another client's KvSet each answer within 2 s,
and the server ends the idle streams it held after stream_idle_s. Then several connections fill the
whole general pool: health, status and heartbeats still answer from the reserved pool.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from axond.control.client import connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import RunningCoordinator
from axond.v1 import coordinator_pb2_grpc as pb_grpc

STREAMS = int(os.environ.get("CONTROL_FLOOD_STREAMS", "600"))
PER_CLIENT = 100
IDLE_S = 2.0
ANSWER_WITHIN_S = 2.0


class Flood:
    """Idle KvStream streams held open from one connection each, on an event loop of their own."""

    def __init__(self, address: str, token: str | None, connections: int, per_connection: int) -> None:
        self.codes: list[grpc.StatusCode] = []
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._args = (address, token, connections, per_connection)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(60), "the flood did not start"

    async def _main(self) -> None:
        address, token, connections, per_connection = self._args
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        meta = (("authorization", f"Bearer {token}"),) if token else ()
        own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each (channels share one by default)
        channels = [grpc.aio.insecure_channel(address, options=own) for _ in range(connections)]
        calls = []
        for ch in channels:
            stub = pb_grpc.CoordinatorStub(ch)
            calls += [stub.KvStream(metadata=meta) for _ in range(per_connection)]  # open, and never send
        tasks = [asyncio.ensure_future(self._ended(c)) for c in calls]
        await asyncio.sleep(0.5)
        self._ready.set()
        await self._stop.wait()
        for c in calls:
            c.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in channels))

    async def _ended(self, call: grpc.aio.StreamStreamCall) -> None:
        code = await call.code()
        if code != grpc.StatusCode.CANCELLED:
            self.codes.append(code)

    def count(self, code: grpc.StatusCode) -> int:
        return sum(c == code for c in list(self.codes))

    def wait_for(self, n: int, timeout: float) -> None:
        """Until `n` streams ended (refused, or closed by the server)."""
        deadline = time.monotonic() + timeout
        while len(self.codes) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.codes) >= n, (n, len(self.codes), self.codes[-5:])

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def timed(call: Callable[[], object]) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
@pytest.mark.timeout(120)
def test_one_clients_idle_streams_cannot_starve_health_status_or_other_clients(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    limits = CoordinatorLimits(max_calls_per_client=PER_CLIENT, max_concurrent_calls=3 * PER_CLIENT,
                               stream_idle_s=IDLE_S)
    running = coordinator_factory(limits=limits)
    with connect(running.address, call_timeout=5.0) as other, grpc.insecure_channel(running.address) as ch:
        node = other.register_node("h").node_id
        other.join("j", node, 1, 1, 1, timeout=5.0)
        store = other.store("j", 1)
        health = health_pb2_grpc.HealthStub(ch)

        def check_all() -> None:
            for name, call in (
                ("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_WITHIN_S)),
                ("status", lambda: other.get_status()),
                ("KvSet", lambda: store.set("k", b"v")),
                ("heartbeat", lambda: other.heartbeat(node)),
            ):
                took = timed(call)
                assert took < ANSWER_WITHIN_S, (name, took)

        flood = Flood(running.address, running.token, connections=1, per_connection=STREAMS)
        try:
            # The flooding client holds at most its share; every stream past it was refused at once.
            flood.wait_for(STREAMS - PER_CLIENT, timeout=60)
            assert running.admission is not None and running.admission.running[0] <= PER_CLIENT + 2
            check_all()
            # The server ends the streams it held once they were idle for stream_idle_s.
            flood.wait_for(STREAMS, timeout=IDLE_S * 3 + 10)
            assert flood.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= STREAMS - 2 * PER_CLIENT, flood.codes[-5:]
            assert flood.count(grpc.StatusCode.UNAVAILABLE) >= PER_CLIENT, flood.codes[-5:]
            assert set(flood.codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
            assert running.admission.running[0] <= 2, running.admission.running
        finally:
            flood.stop()

        # Three connections fill the whole general pool: the reserved pool still answers health, status and
        # heartbeats (a new KV call from elsewhere waits for room, as it should).
        full = Flood(running.address, running.token, connections=3, per_connection=PER_CLIENT)
        try:
            filled = time.monotonic() + 60  # the streams reach the server as fast as a busy machine lets them
            while running.admission.running[0] < 3 * PER_CLIENT - 2 and time.monotonic() < filled:
                time.sleep(0.05)
            assert running.admission.running[0] >= 3 * PER_CLIENT - 2, running.admission.running
            for name, call in (
                ("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_WITHIN_S)),
                ("status", lambda: other.get_status()),
                ("heartbeat", lambda: other.heartbeat(node)),
            ):
                took = timed(call)
                assert took < ANSWER_WITHIN_S, (name, took)
        finally:
            full.stop()
        store.close()
