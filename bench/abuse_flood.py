"""What bench/abuse.py sends: refused requests, and streams held open, from connections of their own."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 << 20)]
"""A TCP connection per channel (channels share one by default), and room for the large requests."""


def _channels(address: str, n: int) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(n)]


async def refused_requests(address: str, n: int, size: int, token: str | None, connections: int,
                           concurrency: int) -> dict[str, int]:
    """`n` KvSet requests of `size` bytes, at most `concurrency` in flight over `connections` connections: without
    a token (`token` None) or with it, for a job that does not exist (refused after the body is decoded).
    Returns how many got each status code."""
    codes: collections.Counter[str] = collections.Counter()
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    meta = (("authorization", f"Bearer {token}"),) if token else ()
    channels = _channels(address, connections)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        stub = pb_grpc.CoordinatorStub(channels[i % connections])
        async with gate:
            try:
                await stub.KvSet(pb.KvSetRequest(job="no-such-job", generation=1, key=f"k{i}", value=value),
                                 metadata=meta, timeout=120)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
    return dict(codes)


class HeldStreams:
    """Streams opened and never finished, `per_connection` of each kind on each of `connections` connections."""

    def __init__(self, address: str, token: str | None, connections: int, watch: int, kv_streams: int) -> None:
        self.address, self.token = address, token
        self.connections, self.watch, self.kv_streams = connections, watch, kv_streams
        self.ended: collections.Counter[str] = collections.Counter()
        self.calls: list[Any] = []
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: list[asyncio.Future[None]] = []

    async def open(self, settle_s: float = 3.0) -> float:
        """Open every stream; returns the seconds it took (with `settle_s` for the refusals to come back)."""
        t0 = time.monotonic()
        meta = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        self._channels = _channels(self.address, self.connections)
        for ch in self._channels:
            health = health_pb2_grpc.HealthStub(ch)
            kv = pb_grpc.CoordinatorStub(ch)
            self.calls += [health.Watch(health_pb2.HealthCheckRequest(), metadata=meta) for _ in range(self.watch)]
            self.calls += [kv.KvStream(metadata=meta) for _ in range(self.kv_streams)]  # opened, never sent to
        self._tasks = [asyncio.ensure_future(self._ended(c)) for c in self.calls]
        await asyncio.sleep(settle_s)
        return time.monotonic() - t0

    async def _ended(self, call: Any) -> None:
        try:
            async for _ in call:  # (a response stream's status arrives only while it is read)
                pass
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            return
        code = await call.code()
        if code != grpc.StatusCode.CANCELLED:
            self.ended[code.name] += 1

    def held(self) -> int:
        return len(self.calls) - sum(self.ended.values())

    async def close(self) -> None:
        for c in self.calls:
            c.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in self._channels))
