"""bench/rendezvous.py --part scale: rendezvous of up to 10,000 simulated nodes with heartbeats on.

Simulated nodes (8 ranks each) are spread over several client processes; each registers, heartbeats
at the interval the coordinator tells it (over its HeartbeatStream, or unary calls), then all Join
one job at once. Measured: the time from the last Join sent to every rank assigned, calls that
failed (after the clients' retries), the coordinator's CPU per heartbeat while only heartbeats run,
and a GetStatus of the whole job (bounded by max_ranks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import grpc
import grpc.aio

from axond.control.client import connect
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc
from rendezvous_common import AUTH, BENCH_CONFIG, COORDINATOR_PIDS, coordinator

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)


async def _retrying(counts: dict[str, int], what: str, call: Any, request: Any, timeout: float) -> Any:
    """`call(request)` sent again with jittered backoff on the codes clients retry, until `timeout`."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        try:
            return await call(request, timeout=max(0.01, deadline - time.monotonic()), metadata=AUTH)
        except grpc.aio.AioRpcError as e:
            if e.code() not in RETRIED or time.monotonic() > deadline - 0.2:
                counts[f"{what} failed"] += 1
                counts.setdefault(f"{what} {e.code().name}: {(e.details() or '')[:60]}", 0)
                raise
            counts[f"{what} retried"] += 1
            why = f"{what} retried {e.code().name}: {(e.details() or '')[:60]} {e.debug_error_string()[:90]}"
            counts[why] = counts.get(why, 0) + 1
            await asyncio.sleep(random.uniform(0, min(1.6, 0.05 * 2 ** attempt)))
            attempt += 1


class _Node:
    """One simulated node: its registration and its heartbeat loop."""

    def __init__(self, stub: pb_grpc.CoordinatorStub, reg: pb.RegisterNodeResponse) -> None:
        self.stub, self.reg = stub, reg
        self.interval = reg.heartbeat_interval_s
        self.job, self.generation = "", 0

    async def heartbeats(self, streamed: bool, counts: dict[str, int], stop: asyncio.Event) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))
        call = self.stub.HeartbeatStream(metadata=AUTH) if streamed else None
        try:
            while not stop.is_set():
                request = pb.HeartbeatRequest(node_id=self.reg.node_id, node_secret=self.reg.node_secret,
                                              job=self.job, generation=self.generation)
                try:
                    if call is not None:
                        await call.write(request)
                        reply = await asyncio.wait_for(call.read(), 10.0)
                    else:
                        reply = await _retrying(counts, "heartbeat", self.stub.Heartbeat, request, 10.0)
                    counts["heartbeats"] += 1
                    self.interval = reply.heartbeat_interval_s or self.interval
                except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                    if call is not None:  # (unary: counted by _retrying)
                        counts["heartbeat failed"] += 1
                        call.cancel()
                        call = self.stub.HeartbeatStream(metadata=AUTH)
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            if call is not None:
                call.cancel()


def scale_client_proc(address: str, first: int, count: int, total: int, nproc: int, job: str, streamed: bool,
                      channels: int, spread: float) -> int:
    """One client process of `count` simulated nodes; talks to the parent by lines on stdin/stdout.

    Its garbage collector runs as a coordinator's does (axond.coordinator.collector): the simulated nodes stand
    for machines of their own, so what the simulator spends on itself here is CPU the coordinator under test
    loses on this machine."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        options = [("grpc.use_local_subchannel_pool", 1)]
        chans = [grpc.aio.insecure_channel(address, options=options) for _ in range(max(1, min(count, channels)))]
        stubs = [pb_grpc.CoordinatorStub(c) for c in chans]
        counts: dict[str, int] = {k: 0 for k in (
            "heartbeats", "heartbeat failed", "heartbeat retried", "register failed", "register retried",
            "join failed", "join retried")}
        limit = asyncio.Semaphore(500)

        async def register(i: int) -> _Node:
            async with limit:
                stub = stubs[i % len(stubs)]
                req = pb.RegisterNodeRequest(hostname=f"sim{first + i:05d}")
                return _Node(stub, await _retrying(counts, "register", stub.RegisterNode, req, 120.0))

        nodes = await asyncio.gather(*(register(i) for i in range(count)))
        stop = asyncio.Event()
        beating = [asyncio.ensure_future(n.heartbeats(streamed, counts, stop)) for n in nodes]
        print(json.dumps({"ready": True}), flush=True)
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "mark":
            print(json.dumps({"heartbeats": counts["heartbeats"]}), flush=True)
        sent: list[float] = []
        begun = time.time()

        async def join(node: _Node) -> pb.JoinResponse:
            await asyncio.sleep(random.uniform(0, spread))
            req = pb.JoinRequest(job=job, node_id=node.reg.node_id, node_secret=node.reg.node_secret, nproc=nproc,
                                 min_nodes=total, max_nodes=total, timeout_s=120.0)
            sent.append(time.time())
            reply = await _retrying(counts, "join", node.stub.Join, req, 130.0)
            node.job, node.generation = job, reply.generation
            return reply

        answers = await asyncio.gather(*(join(n) for n in nodes), return_exceptions=True)
        answered = time.time()
        ranks = sum(a.local_world_size for a in answers if isinstance(a, pb.JoinResponse))
        print(json.dumps({"begun": begun, "last_sent": max(sent), "answered": answered, "ranks": ranks}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        stop.set()
        await asyncio.gather(*beating, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in chans))
        print(json.dumps(counts), flush=True)

    asyncio.run(run())
    return 0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ask(children: list[subprocess.Popen[str]], line: str | None) -> list[dict[str, Any]]:
    out = []
    for child in children:
        if line is not None:
            assert child.stdin is not None
            child.stdin.write(line + "\n")
            child.stdin.flush()
    for child in children:
        assert child.stdout is not None
        text = child.stdout.readline()
        if not text:
            raise RuntimeError(f"a simulated-node process exited {child.wait(10)}")
        out.append(json.loads(text))
    return out


def scale_once(address: str, n: int, procs: int, nproc: int, streamed: bool, hb_window: float,
               channels: int, spread: float) -> dict[str, Any]:
    """One rendezvous of `n` simulated nodes; returns the row's figures."""
    job = f"scale-{n}-{time.monotonic_ns()}"
    shares = [n // procs + (1 if p < n % procs else 0) for p in range(procs)]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rendezvous.py")
    children = [
        subprocess.Popen([sys.executable, script, "--scale-client",
                          json.dumps([address, sum(shares[:p]), share, n, nproc, job, streamed, channels, spread])],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for p, share in enumerate(shares)
    ]
    pid = COORDINATOR_PIDS[address]
    try:
        t_reg = time.perf_counter()
        _ask(children, None)
        registered_s = time.perf_counter() - t_reg
        time.sleep(hb_window)  # past the registration burst: every node paced by the interval it was told
        beats0, cpu0, t0 = sum(r["heartbeats"] for r in _ask(children, "mark")), _cpu_seconds(pid), time.perf_counter()
        time.sleep(hb_window)
        beats1, cpu1, t1 = sum(r["heartbeats"] for r in _ask(children, "mark")), _cpu_seconds(pid), time.perf_counter()
        profiling = bool(os.environ.get("AXOND_BENCH_PROFILE"))
        if profiling:  # the profile covers the rendezvous only (rendezvous_common.profiled)
            os.kill(pid, signal.SIGUSR1)
        cpu_go, clients_go = _cpu_seconds(pid), sum(_cpu_seconds(c.pid) for c in children)
        joined = _ask(children, "go")
        cpu_joined, clients_joined = _cpu_seconds(pid), sum(_cpu_seconds(c.pid) for c in children)
        if profiling:
            os.kill(pid, signal.SIGUSR2)
        rendezvous_s = max(r["answered"] for r in joined) - max(r["last_sent"] for r in joined)
        whole_s = max(r["answered"] for r in joined) - min(r["begun"] for r in joined)
        with connect(address, token=BENCH_CONFIG.token, call_timeout=30.0) as c:
            ts = time.perf_counter()
            status = c.get_status(job=job, max_ranks=1024)
            status_ms = (time.perf_counter() - ts) * 1e3
            status_bytes = status.ByteSize()
            j = status.jobs[0]
            state = pb.JobState.Name(j.state)
        counts = _ask(children, "stop")
    finally:
        for child in children:
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
    beats = beats1 - beats0
    print(f"  ... calls: {counts}", file=sys.stderr, flush=True)
    failed = sum(v for c in counts for k, v in c.items() if k.endswith("failed"))
    retried = sum(v for c in counts for k, v in c.items() if k.endswith("retried"))
    return {
        "nodes": n, "ranks": sum(r["ranks"] for r in joined), "registered_s": registered_s,
        "rendezvous_s": rendezvous_s, "whole_s": whole_s, "spread": spread, "hb_per_s": beats / (t1 - t0),
        "cpu_per_hb_us": (cpu1 - cpu0) / beats * 1e6 if beats else 0.0, "cpu_share": (cpu1 - cpu0) / (t1 - t0),
        "join_cpu_s": cpu_joined - cpu_go, "clients_join_cpu_s": clients_joined - clients_go,
        "failed": failed, "retried": retried, "state": state, "nnodes": j.nnodes, "listed": len(j.ranks),
        "omitted": j.ranks_omitted, "status_ms": status_ms, "status_bytes": status_bytes,
    }


def part_scale(nodes: list[int], procs: int, nproc: int, transports: list[str], store: str, hb_window: float,
               channels: int, spreads: list[float]) -> None:
    """The rendezvous table for each node count and heartbeat transport."""
    rows = []
    for transport in transports:
        for n in nodes:
            for spread in spreads:
                with tempfile.TemporaryDirectory(prefix="axond-bench-state-") as state_dir:
                    config = dataclasses.replace(BENCH_CONFIG, heartbeat_interval=1.0, in_memory=store == "memory",
                                                 state_dir=state_dir)
                    with coordinator("process", config) as address:  # a fresh one: no nodes left from a row before
                        rows.append((transport, scale_once(address, n, procs, nproc, transport == "stream",
                                                           hb_window, channels, spread)))
                print(f"  ... {transport} {n}: {rows[-1][1]}", file=sys.stderr, flush=True)
    print(f"## (scale) rendezvous with heartbeats on: {nproc} ranks per node, {procs} client processes "
          f"({channels} connections each), coordinator in its own process ({store}, base heartbeat interval 1 s, "
          f"max_heartbeat_rate 500/s), {os.cpu_count()} CPUs\n")
    print("| heartbeats | nodes | ranks | Joins sent over s | first Join -> all ranks s | last Join -> all ranks s "
          "| coordinator CPU s (Joins to all ranks) | clients' CPU s (same) | heartbeats/s | coordinator CPU per heartbeat us "
          "| coordinator CPU (heartbeats only) | failed calls | retried calls | job state | GetStatus ms (ranks listed, "
          "omitted, bytes) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for transport, r in rows:
        print(f"| {transport} | {r['nodes']:,} | {r['ranks']:,} | {r['spread']:g} | {r['whole_s']:.2f} | "
              f"{r['rendezvous_s']:.2f} | {r['join_cpu_s']:.2f} | {r['clients_join_cpu_s']:.2f} | {r['hb_per_s']:,.0f} | "
              f"{r['cpu_per_hb_us']:,.0f} | {r['cpu_share']:.0%} | {r['failed']} | {r['retried']} | "
              f"{r['state'].removeprefix('JOB_STATE_')} ({r['nnodes']:,} nodes) | {r['status_ms']:.0f} "
              f"({r['listed']:,}, {r['omitted']:,}, {r['status_bytes']:,}) |")
