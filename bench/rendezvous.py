"""Control-plane benchmarks against a real coordinator on loopback.

Part (a): rendezvous latency (first Join sent -> every node has its ranks) for N simulated nodes,
each with its own gRPC channel, and KV-store operations per second. Run:

    python bench/rendezvous.py --part a [--nodes 2,64,1024] [--server process|thread]

Part (kv): KV throughput over gRPC: N concurrent clients (each its own connection, spread over several
client processes) doing set/get, against a coordinator in memory, durable (SQLite, group commit) and
durable with --fsync; ops/s and per-call latency percentiles:

    python bench/rendezvous.py --part kv [--clients 100,500] [--client-procs 4] [--kv-seconds 5] [--kv-rounds 3]
        [--kv-mix mixed|set|get|health] [--kv-stores memory,sqlite,fsync] [--kv-connections N]
        [--kv-transports unary,stream] [--kv-streams N]

(bench/rendezvous_kv.py.) Part (scale): N simulated nodes (8 ranks each) over several client processes,
heartbeating at the interval the coordinator tells them, all joining one job; time from the last Join
to every rank assigned, failed calls, coordinator CPU per heartbeat, GetStatus of the job
(bench/rendezvous_scale.py):

    python bench/rendezvous.py --part scale [--scale-nodes 1000,10000] [--scale-procs 4]
        [--scale-heartbeats stream,unary] [--scale-store memory|sqlite]

Part (b): wall time of a one-node job of N local ranks, `axond worker` against a running coordinator
beside `torchrun --rdzv-backend=c10d` (when torch is importable), each rank doing init + barrier:

    python bench/rendezvous.py --part b [--nprocs 2,4,8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import grpc
import grpc.aio

from axond.control.client import connect
from axond.coordinator.server import CoordinatorConfig, start_coordinator
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rendezvous_common import AUTH, BENCH_CONFIG, coordinator as _coordinator
from rendezvous_kv import kv_client_proc, part_kv
from rendezvous_scale import part_scale, scale_client_proc


async def _rendezvous_once(address: str, n: int, job: str, nproc: int) -> float:
    channels = [grpc.aio.insecure_channel(address) for _ in range(n)]
    try:
        stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
        regs = await asyncio.gather(
            *(
                s.RegisterNode(pb.RegisterNodeRequest(hostname=f"node{i:04d}"), timeout=60, metadata=AUTH)
                for i, s in enumerate(stubs)
            )
        )
        t0 = time.perf_counter()
        joins = await asyncio.gather(
            *(
                s.Join(
                    pb.JoinRequest(job=job, node_id=r.node_id, nproc=nproc, min_nodes=n, max_nodes=n, timeout_s=60,
                                   node_secret=r.node_secret),
                    timeout=70, metadata=AUTH,
                )
                for s, r in zip(stubs, regs)
            )
        )
        elapsed = time.perf_counter() - t0
        ranks = sorted(j.rank_offset + i for j in joins for i in range(j.local_world_size))
        if ranks != list(range(n * nproc)):
            raise RuntimeError(f"rendezvous of {n} nodes assigned wrong ranks")
        return elapsed
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))


def _kv_rates(address: str, seconds: float) -> dict[str, float]:
    """Sequential round-trip rates of one client, and pipelined rates of 64 concurrent callers."""
    out: dict[str, float] = {}
    with connect(address, token=BENCH_CONFIG.token, call_timeout=10.0) as c:
        node = c.register_node("kv-bench").node_id
        gen = c.join("kv", node, 1, 1, 1, timeout=10.0).generation
        store = c.store("kv", gen)
        value = b"x" * 64
        keys = 1000
        ops: dict[str, Callable[[int], object]] = {
            "set": lambda i: store.set(f"k{i % keys}", value),
            "get": lambda i: store.get(f"k{i % keys}", timeout=1.0),
            "add": lambda i: store.add("counter", 1),
        }
        for name, op in ops.items():
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                op(count)
                count += 1
            out[f"{name} (1 client, sequential)"] = count / (time.perf_counter() - t0)
            if name == "set":
                keys = min(keys, count)  # get reads only keys that were set

    async def pipelined() -> float:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            count, t0 = 0, time.perf_counter()

            async def worker(w: int) -> None:
                nonlocal count
                while time.perf_counter() - t0 < seconds:
                    await stub.KvSet(pb.KvSetRequest(job="kv", generation=gen, key=f"w{w}", value=value), timeout=10,
                                            metadata=AUTH)
                    count += 1

            await asyncio.gather(*(worker(w) for w in range(64)))
            return count / (time.perf_counter() - t0)

    out["set (64 concurrent callers)"] = asyncio.run(pipelined())
    return out


def part_a(nodes: list[int], repeats: int, server: str, nproc: int = 8, kv_seconds: float = 1.0) -> None:
    """Rendezvous time for each N and KV ops/s; prints markdown tables."""
    with _coordinator(server) as address:
        print(f"## (a) rendezvous: first Join -> all ranks assigned ({nproc} ranks per node, coordinator in a {server})\n")
        print("| nodes | world size | median s | min s | max s |")
        print("|---:|---:|---:|---:|---:|")
        for n in nodes:
            times = [asyncio.run(_rendezvous_once(address, n, f"rdzv-{n}-{r}", nproc)) for r in range(repeats)]
            print(f"| {n} | {n * nproc} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |")
            sys.stdout.flush()
        in_memory = _kv_rates(address, kv_seconds)
    with tempfile.TemporaryDirectory(prefix="axond-bench-state-") as state_dir:
        with _coordinator(server, dataclasses.replace(BENCH_CONFIG, in_memory=False, state_dir=state_dir)) as address:
            durable = _kv_rates(address, kv_seconds)
    print("\n## (a) KV store, 64-byte values: in memory, and durable (SQLite in the state directory)\n")
    print("| operation | in memory ops/s | durable ops/s | durable / in memory |")
    print("|---|---:|---:|---:|")
    for name, rate in in_memory.items():
        print(f"| {name} | {rate:,.0f} | {durable[name]:,.0f} | {durable[name] / rate:.2f} |")


AXOND_RANK = "import axond; axond.init_process_group(backend='tcp'); axond.barrier(); axond.destroy_process_group()"
TORCH_RANK = (
    "import torch.distributed as dist; dist.init_process_group('gloo'); dist.barrier(); dist.destroy_process_group()"
)
LAUNCH_TIMEOUT_S = 300.0


def _axond_argv() -> list[str]:
    script = shutil.which("axond", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [script] if script else [sys.executable, "-c", "from axond.cli.main import main; main()"]


def _wall_time(argv: list[str]) -> float:
    """Seconds from start to exit of `argv`; raises if it fails (a failed run is not a timing)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def _time_axond(address: str, nproc: int, rank_code: str, job: str) -> float:
    return _wall_time([
        *_axond_argv(), "worker", "--coordinator", address, "--job", job, "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--", sys.executable, "-c", rank_code,
    ])


def _time_torchrun(nproc: int, rank_code: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _wall_time([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id", f"bench-{time.monotonic_ns()}",
        "--", "-c", rank_code,
    ])


def part_b(nprocs: list[int], repeats: int) -> None:
    """Wall time of a whole one-node job, `axond worker` vs torchrun (c10d); prints a markdown table.

    "launch only" runs a rank that does nothing (the agent's own cost); "init+barrier" runs
    `axond.init_process_group()` + `axond.barrier()` (torch: gloo `init_process_group` + `barrier`).
    The torchrun columns appear only when torch is importable. Median of `repeats` runs.
    """
    has_torch = importlib.util.find_spec("torch") is not None
    running = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True))
    jobs = itertools.count()
    cols = ["axond launch only", "axond init+barrier"]
    if has_torch:
        cols += ["torchrun launch only", "torchrun init+barrier"]
    try:
        print(f"## (b) one-node job wall time, seconds (median of {repeats}; {os.cpu_count()} CPUs)\n")
        print("| N | " + " | ".join(cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for n in nprocs:
            cells = [
                statistics.median(_time_axond(running.address, n, code, f"b-{next(jobs)}") for _ in range(repeats))
                for code in ("pass", AXOND_RANK)
            ]
            if has_torch:
                cells.append(statistics.median(_time_torchrun(n, "pass") for _ in range(repeats)))
                cells.append(statistics.median(_time_torchrun(n, TORCH_RANK) for _ in range(repeats)))
            print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
            sys.stdout.flush()
    finally:
        running.stop(grace=0.5)


def main(argv: list[str] | None = None) -> int:
    parts: dict[str, Callable[[argparse.Namespace], None]] = {
        "a": lambda args: part_a([int(x) for x in args.nodes.split(",")], args.repeats, args.server),
        "b": lambda args: part_b([int(x) for x in args.nprocs.split(",")], args.repeats),
        "scale": lambda args: part_scale([int(x) for x in args.scale_nodes.split(",")], args.scale_procs, 8,
                                         args.scale_heartbeats.split(","), args.scale_store, args.scale_hb_window,
                                         args.scale_connections, [float(x) for x in args.scale_spread.split(",")]),
        "kv": lambda args: part_kv([int(x) for x in args.clients.split(",")], args.client_procs, args.kv_seconds,
                                   args.kv_mix, args.kv_stores.split(","), args.kv_connections, args.kv_rounds,
                                   tuple(args.kv_transports.split(",")), args.kv_streams),
    }
    if argv is None and sys.argv[1:2] == ["--kv-client"]:
        print(json.dumps(kv_client_proc(*json.loads(sys.argv[2]))))
        return 0
    if argv is None and sys.argv[1:2] == ["--scale-client"]:
        return scale_client_proc(*json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=sorted(parts) + ["all"], default="all", help="which benchmark to run")
    parser.add_argument("--nodes", default="2,64,1024", help="(a) comma-separated simulated node counts")
    parser.add_argument("--nprocs", default="2,4,8", help="(b) comma-separated local rank counts")
    parser.add_argument("--repeats", type=int, default=3, help="(a) rendezvous / (b) job repetitions per count")
    parser.add_argument(
        "--server", choices=["process", "thread"], default="process",
        help="(a) run the coordinator in its own process (default) or in a thread of this one",
    )
    parser.add_argument("--scale-nodes", default="1000,10000", help="(scale) comma-separated simulated node counts")
    parser.add_argument("--scale-spread", default="0",
                        help="(scale) comma-separated seconds over which the nodes send their Joins (0: all at once)")
    parser.add_argument("--scale-procs", type=int, default=4, help="(scale) processes the nodes are spread over")
    parser.add_argument("--scale-connections", type=int, default=64, help="(scale) connections per process")
    parser.add_argument("--scale-heartbeats", default="stream",
                        help="(scale) comma-separated heartbeat transports: stream (HeartbeatStream), unary")
    parser.add_argument("--scale-store", choices=["memory", "sqlite"], default="memory", help="(scale) coordinator state")
    parser.add_argument("--scale-hb-window", type=float, default=5.0,
                        help="(scale) seconds of heartbeats only before the coordinator's CPU is sampled, and the sample")
    parser.add_argument("--clients", default="100,500", help="(kv) comma-separated concurrent client counts")
    parser.add_argument("--client-procs", type=int, default=4, help="(kv) processes the clients are spread over")
    parser.add_argument("--kv-connections", type=int, default=1_000_000,
                        help="(kv) connections per client process (default: one per client)")
    parser.add_argument("--kv-rounds", type=int, default=3, help="(kv) interleaved rounds (median reported)")
    parser.add_argument("--kv-seconds", type=float, default=5.0, help="(kv) measured seconds per row")
    parser.add_argument("--kv-mix", choices=["mixed", "set", "get", "health"], default="mixed",
                        help="(kv) what each client does: alternate set and get (default), only set, only get, or "
                        "only health checks (the gRPC server's own ceiling: no state, no commit)")
    parser.add_argument("--kv-transports", default="unary,stream",
                        help="(kv) comma-separated: unary (a call per request), stream (KvStream, batched)")
    parser.add_argument("--kv-streams", type=int, default=0,
                        help="(kv) KV streams per client process, shared by its clients (default 0: one per client)")
    parser.add_argument("--kv-stores", default="memory,sqlite,fsync",
                        help="(kv) comma-separated stores: memory, sqlite, fsync (SQLite with --fsync)")
    args = parser.parse_args(argv)
    for name in ["a", "b"] if args.part == "all" else [args.part]:
        parts[name](args)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
