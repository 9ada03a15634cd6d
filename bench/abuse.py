"""What a stranger (no token) or one token holder can make the coordinator hold: memory and capacity.

Part (memory): a coordinator process on loopback (`axond coordinator`, so with its serving collector settings) is
sent N unauthenticated KvSet requests of M MiB, then N authenticated ones it refuses (a job that does not exist);
its RSS before, after each flood and at its peak:

    python bench/abuse.py --part memory [--requests 300] [--mib 2] [--concurrency 32,300]

Part (cgroup): the same coordinator in a memory cgroup of --limit-mib (cgroup v1 or v2, as root), sent N
unauthenticated requests of M MiB all at once over 26 connections; whether it survives and still answers:

    python bench/abuse.py --part cgroup [--requests 1000] [--mib 7.9] [--limit-mib 1024] [--authenticated]

Part (collector): what each call leaves to Python's cyclic garbage collector, in an in-process coordinator with the
serving collector settings (coordinator/collector.py): young collections while N calls are served, and the
objects a collection finds after N calls with the collector off (successful, refused and unauthenticated KvSets):

    python bench/abuse.py --part collector [--requests 2000]

Part (capacity): three network-namespace hosts (axond/testing/netns.py, as root): the coordinator in one, a
flood in another (26 connections of 1,000 Watch streams without a token; then one token holder's 26 connections
of 1,000 Watch streams and 2,000 idle KvStreams each), and in the third `axond health`, `axond status`, another
client's KvSet, a new node and a new job, each timed, before and under each flood:

    python bench/abuse.py --part capacity [--connections 26] [--watch 1000] [--kv-streams 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from abuse_flood import refused_requests

TOKEN = "abuse-bench"
AXOND = str(Path(sys.executable).with_name("axond"))
"""The `axond` the coordinator runs as (--axond: another install's, e.g. the tree before a change)."""


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status field in MiB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise KeyError(field)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def coordinator(prefix: list[str] | None = None, host: str = "127.0.0.1"
                ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`axond coordinator` in memory on loopback (after `prefix`, e.g. a cgroup entry); yields (address, process)."""
    port = _free_port()
    argv = [*(prefix or []), AXOND, "coordinator", "--in-memory", "--host", host, "--port", str(port), "--token", TOKEN]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        if "listening" not in line:
            raise RuntimeError(f"the coordinator did not start: {line!r}")
        time.sleep(1.0)
        yield f"{host}:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def part_memory(requests: int, mib: float, concurrencies: list[int]) -> None:
    size = int(mib * (1 << 20))
    print(f"| in flight | RSS at start (MiB) | after {requests} unauthenticated (MiB) | after {requests} "
          "authenticated refused (MiB) | growth (MiB) | peak (MiB) | codes |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for concurrency in concurrencies:
        with coordinator() as (address, proc):
            start = _status(proc.pid, "VmRSS")
            anonymous = asyncio.run(refused_requests(address, requests, size, None, 8, concurrency))
            after_anonymous = _status(proc.pid, "VmRSS")
            refused = asyncio.run(refused_requests(address, requests, size, TOKEN, 8, concurrency))
            time.sleep(0.5)
            end, peak = _status(proc.pid, "VmRSS"), _status(proc.pid, "VmHWM")
            print(f"| {concurrency} | {start} | {after_anonymous} | {end} | {end - start} | {peak} | "
                  f"{anonymous} / {refused} |", flush=True)


class Cgroup:
    """A memory cgroup of its own (v2 under /sys/fs/cgroup, else v1's memory controller); removed by `close`."""

    def __init__(self, limit: int) -> None:
        name = f"axond-abuse-{os.getpid()}"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "memory" in v2.read_text():
            self.path, self.v2 = Path("/sys/fs/cgroup") / name, True
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            self.path, self.v2 = Path("/sys/fs/cgroup/memory") / name, False
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))

    def prefix(self) -> list[str]:
        return ["/bin/sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    def peak_mib(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        p = self.path / name
        return int(p.read_text()) >> 20 if p.exists() else -1

    def oom_kills(self) -> str:
        p = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        return " ".join(line for line in p.read_text().split("\n") if "oom_kill" in line)

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def part_cgroup(requests: int, mib: float, limit_mib: int, authenticated: bool) -> None:
    if os.geteuid() != 0:
        print("skipped: needs root to make a memory cgroup")
        return
    try:
        group = Cgroup(limit_mib << 20)
    except OSError as e:
        print(f"skipped: cannot make a memory cgroup ({e})")
        return
    size = int(mib * (1 << 20))
    try:
        with coordinator(group.prefix()) as (address, proc):
            start = _status(proc.pid, "VmRSS")
            t0 = time.monotonic()
            token = TOKEN if authenticated else None
            codes = asyncio.run(refused_requests(address, requests, size, token, 26, requests))
            took = time.monotonic() - t0
            alive = proc.poll() is None
            answer = subprocess.run([AXOND, "health", "--coordinator", address, "--token", TOKEN, "--timeout", "5"],
                                    capture_output=True, text=True, timeout=30)
            end = _status(proc.pid, "VmRSS") if alive else -1
            who = "authenticated (refused: no such job)" if authenticated else "unauthenticated"
            print(f"| {requests} x {mib} MiB {who}, all at once | limit {limit_mib} MiB | "
                  f"{'survived' if alive else 'DIED (' + str(proc.returncode) + ')'} | RSS {start} -> {end} MiB | "
                  f"cgroup peak {group.peak_mib()} MiB | {group.oom_kills()} | {took:.1f} s | {codes} | "
                  f"health after: exit {answer.returncode} |", flush=True)
    finally:
        group.close()


def part_collector(n: int) -> None:
    import collections
    import gc

    import grpc

    from axond.coordinator.collector import tune_for_serving
    from axond.coordinator.server import CoordinatorConfig, start_coordinator
    from axond.v1 import coordinator_pb2 as pb
    from axond.v1 import coordinator_pb2_grpc as pb_grpc

    running = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, token=TOKEN, in_memory=True))
    tune_for_serving()
    auth = [("authorization", f"Bearer {TOKEN}")]
    channel = grpc.insecure_channel(running.address)
    stub = pb_grpc.CoordinatorStub(channel)
    node = stub.RegisterNode(pb.RegisterNodeRequest(hostname="h"), metadata=auth)
    stub.Join(pb.JoinRequest(job="j", node_id=node.node_id, node_secret=node.node_secret, nproc=1, min_nodes=1,
                             max_nodes=1, timeout_s=10), metadata=auth)
    value = b"v" * 100
    kinds = {
        "KvSet, served": lambda i: stub.KvSet(pb.KvSetRequest(job="j", generation=1, key=f"k{i % 50}", value=value),
                                              metadata=auth),
        "KvSet, refused (no such job)": lambda i: stub.KvSet(pb.KvSetRequest(job="nope", generation=1, key="k",
                                                                             value=value), metadata=auth),
        "KvSet, no token": lambda i: stub.KvSet(pb.KvSetRequest(job="j", generation=1, key="k", value=value)),
    }

    def run(call: Callable[[int], object], count: int) -> None:
        for i in range(count):
            try:
                call(i)
            except grpc.RpcError:
                pass

    print(f"thresholds {gc.get_threshold()}; {n} calls of each kind")
    print("| call | collections while serving (by generation) | objects left in cycles per call | bytes per call "
          "| the most common |")
    print("|---|---|---:|---:|---|")
    for name, call in kinds.items():
        run(call, 50)
        counts: collections.Counter[int] = collections.Counter()

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                counts[info["generation"]] += 1

        gc.callbacks.append(count)
        run(call, n)
        gc.callbacks.remove(count)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            run(call, n)
            gc.collect()
            found = len(gc.garbage)
            size = sum(sys.getsizeof(o) for o in gc.garbage)
            common = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(4)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        print(f"| {name} | {dict(sorted(counts.items()))} | {found / n:.1f} | {size / n:.0f} | {common} |", flush=True)
    channel.close()
    running.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["memory", "cgroup", "collector", "capacity"], required=True)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--mib", type=float, default=None)
    ap.add_argument("--concurrency", default="32,300")
    ap.add_argument("--limit-mib", type=int, default=1024)
    ap.add_argument("--authenticated", action="store_true", help="cgroup: send the token (the requests are refused "
                    "after they are decoded)")
    ap.add_argument("--connections", type=int, default=26)
    ap.add_argument("--watch", type=int, default=1000)
    ap.add_argument("--kv-streams", type=int, default=2000)
    ap.add_argument("--axond", default=None, help="the axond command that runs the coordinator (default: this venv's)")
    args = ap.parse_args()
    if args.axond:
        global AXOND
        AXOND = args.axond
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that cgroups and namespaces are removed
    if args.part == "memory":
        part_memory(args.requests or 300, args.mib or 2.0, [int(c) for c in args.concurrency.split(",")])
    elif args.part == "collector":
        part_collector(args.requests or 2000)
    elif args.part == "cgroup":
        part_cgroup(args.requests or 1000, args.mib or 7.9, args.limit_mib, args.authenticated)
    else:
        from abuse_capacity import part_capacity

        part_capacity(args.connections, args.watch, args.kv_streams)


if __name__ == "__main__":
    main()
