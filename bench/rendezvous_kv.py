"""bench/rendezvous.py --part kv: KV throughput over gRPC, unary calls against KvStream.

N concurrent callers spread over several client processes, each caller one request at a time, against
a coordinator in memory, durable (SQLite, group commit) and durable with --fsync; ops/s and latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from axond.control.client import connect
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc
from rendezvous_common import AUTH, BENCH_CONFIG, coordinator


class _AioKvStream:
    """One KvStream of a benchmark client process: callers' requests batched into messages, answers by id."""

    def __init__(self, stub: pb_grpc.CoordinatorStub) -> None:
        self._queue: asyncio.Queue[pb.KvOp] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[pb.KvResult]] = {}
        self._ids = itertools.count(1)
        self._call = stub.KvStream(metadata=AUTH, timeout=600)
        self._tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def _write(self) -> None:
        while True:
            ops = [await self._queue.get()]
            while not self._queue.empty() and len(ops) < 512:
                ops.append(self._queue.get_nowait())
            await self._call.write(pb.KvStreamRequest(ops=ops))

    async def _read(self) -> None:
        async for message in self._call:
            for result in message.results:
                self._waiting.pop(result.id).set_result(result)

    async def call(self, op: pb.KvOp) -> pb.KvResult:
        op.id = next(self._ids)
        fut = self._waiting[op.id] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(op)
        return await asyncio.wait_for(fut, 30)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._call.cancel()


def kv_client_proc(address: str, job: str, gen: int, first: int, clients: int, start_at: float, seconds: float,
                    mix: str, connections: int, transport: str = "unary", streams: int = 0) -> dict[str, object]:
    """One client process: `clients` callers over `connections` connections, each caller one call at a time
    (`transport` unary: a call each; stream: over `streams` KV streams, 0 meaning one per caller)."""
    value = b"x" * 64

    async def run() -> dict[str, object]:
        options = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(min(clients, connections))]
        latencies: list[float] = []
        errors = 0
        kv_streams: list[_AioKvStream] = []
        try:
            stubs = [pb_grpc.CoordinatorStub(channels[i % len(channels)]) for i in range(clients)]
            health_stubs = [health_pb2_grpc.HealthStub(channels[i % len(channels)]) for i in range(clients)]
            await asyncio.gather(*(s.KvSet(pb.KvSetRequest(job=job, generation=gen, key=f"c{first + i}/0", value=value),
                                           timeout=60, metadata=AUTH) for i, s in enumerate(stubs)))
            if transport == "stream":
                kv_streams = [_AioKvStream(stubs[i]) for i in range(min(clients, streams or clients))]
            await asyncio.sleep(max(0.0, start_at - time.time()))
            end = time.perf_counter() + seconds

            async def caller(i: int, stub: pb_grpc.CoordinatorStub) -> None:
                nonlocal errors
                n = 0
                while True:
                    key = f"c{first + i}/{n % 16}"
                    t0 = time.perf_counter()
                    if t0 >= end:
                        return
                    setting = mix == "set" or (mix == "mixed" and n % 2 == 0)
                    try:
                        if mix == "health":
                            await health_stubs[i].Check(health_pb2.HealthCheckRequest(), timeout=30)
                        elif kv_streams:
                            op = (pb.KvOp(set=pb.KvSetRequest(job=job, generation=gen, key=key, value=value)) if setting
                                  else pb.KvOp(get=pb.KvGetRequest(job=job, generation=gen, key=f"c{first + i}/0")))
                            if (await kv_streams[i % len(kv_streams)].call(op)).code:
                                raise RuntimeError("a KV stream request failed")
                        elif setting:
                            await stub.KvSet(pb.KvSetRequest(job=job, generation=gen, key=key, value=value),
                                             timeout=30, metadata=AUTH)
                        else:
                            await stub.KvGet(pb.KvGetRequest(job=job, generation=gen, key=f"c{first + i}/0"),
                                             timeout=30, metadata=AUTH)
                        latencies.append(time.perf_counter() - t0)
                    except (grpc.aio.AioRpcError, RuntimeError, asyncio.TimeoutError):
                        errors += 1
                    n += 1

            await asyncio.gather(*(caller(i, s) for i, s in enumerate(stubs)))
        finally:
            for kv_stream in kv_streams:
                kv_stream.close()
            await asyncio.gather(*(ch.close() for ch in channels))
        return {"latencies": latencies, "errors": errors}

    return asyncio.run(run())


def kv_load(address: str, clients: int, procs: int, seconds: float, mix: str,
             connections: int, transport: str = "unary", streams: int = 0) -> tuple[float, float, float, int]:
    """(ops/s, p50 ms, p99 ms, failed calls) of `clients` callers spread over `procs` processes."""
    with connect(address, token=BENCH_CONFIG.token, call_timeout=10.0) as c:
        node = c.register_node("kv-load").node_id
        job = f"kv-{clients}-{time.monotonic_ns()}"
        gen = c.join(job, node, 1, 1, 1, timeout=10.0).generation
    start_at = time.time() + 2.0 + clients / 250
    shares = [clients // procs + (1 if p < clients % procs else 0) for p in range(procs)]
    children = []
    for p, share in enumerate(shares):
        args = json.dumps([address, job, gen, sum(shares[:p]), share, start_at, seconds, mix, connections, transport,
                           streams])
        children.append(subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rendezvous.py"), "--kv-client", args], stdout=subprocess.PIPE))
    latencies: list[float] = []
    errors = 0
    for child in children:
        out, _ = child.communicate(timeout=seconds + 120)
        if child.returncode != 0:
            raise RuntimeError(f"a KV client process exited {child.returncode}")
        got = json.loads(out)
        latencies += got["latencies"]
        errors += got["errors"]
    latencies.sort()
    if not latencies:
        return 0.0, 0.0, 0.0, errors
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3
    return len(latencies) / seconds, pick(0.50), pick(0.99), errors


def part_kv(clients: list[int], procs: int, seconds: float, mix: str, stores: list[str], connections: int,
            rounds: int, transports: tuple[str, ...] = ("unary",), streams: int = 0) -> None:
    """KV ops/s and latency over gRPC for each transport, store and client count (median of `rounds` interleaved
    rounds)."""
    labels = {"memory": "in memory", "sqlite": "SQLite", "fsync": "SQLite --fsync"}
    got: dict[tuple[str, str, int], list[tuple[float, float, float, int]]] = {}
    for _ in range(rounds):
        for store in stores:
            with tempfile.TemporaryDirectory(prefix="axond-bench-state-") as state_dir:
                config = BENCH_CONFIG if store == "memory" else dataclasses.replace(
                    BENCH_CONFIG, in_memory=False, state_dir=state_dir, fsync=store == "fsync")
                with coordinator("process", config) as address:
                    for transport in transports:
                        for n in clients:
                            got.setdefault((transport, store, n), []).append(
                                kv_load(address, n, min(procs, n), seconds, mix, connections, transport, streams))
    shared = "one per client" if not streams else f"{streams} per client process, shared by its clients"
    print(f"## (kv) KV store over gRPC: {mix} calls, 64-byte values, {procs} client processes, "
          f"{'one connection per client' if connections >= max(clients) else f'{connections} connection(s) per process'}, "
          f"KV streams: {shared}; {seconds:g} s per row, median of {rounds} interleaved rounds, coordinator in its "
          f"own process ({os.cpu_count()} CPUs)\n")
    print("| transport | store | clients | ops/s | vs in memory | p50 ms | p99 ms | failed calls |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for transport in transports:
        for store in stores:
            for n in clients:
                rows = got[(transport, store, n)]
                rate, p50, p99 = (statistics.median(r[i] for r in rows) for i in range(3))
                memory = got.get((transport, "memory", n))
                base = statistics.median(r[0] for r in memory) if memory else None
                ratio = f"{rate / base:.2f}" if base else "-"
                print(f"| {transport} | {labels[store]} | {n} | {rate:,.0f} | {ratio} | {p50:.1f} | {p99:.1f} | "
                      f"{sum(r[3] for r in rows)} |")
