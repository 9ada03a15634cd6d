"""Coordinator replicas on etcd: failover time, and KV throughput of an etcd-backed coordinator vs SQLite.

Needs `etcd` on PATH (Debian: etcd-server); it starts its own on free loopback ports with a temporary
data directory. Every coordinator is an `axond coordinator` process on loopback.

- failover: two replicas, a client given both addresses doing KvSet in a loop; the leader is killed
  (SIGKILL, or SIGTERM: a clean stop resigns) and the time from the signal to the client's first
  successful KvSet on the new leader is measured. The killed replica is started again as a follower.
- kv: `bench/rendezvous.py`'s KV load (mixed KvSet/KvGet, 64-byte values, several client processes)
  against one coordinator with SQLite state and one replica with etcd state.

Run: `python bench/failover.py` (see --help).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rendezvous  # bench/rendezvous.py: the KV load

from axond.control.client import connect
from axond.coordinator.persistence.etcd import EtcdClient, EtcdError

TOKEN = rendezvous.BENCH_CONFIG.token or "bench"
AXOND = [sys.executable, "-c", "from axond.cli.main import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _etcd() -> Iterator[str]:
    """A single-member etcd on loopback; yields its client endpoint."""
    binary = shutil.which("etcd")
    if binary is None:
        sys.exit("bench/failover.py needs etcd on PATH (Debian/Ubuntu: apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="axond-bench-etcd-") as work:
        client_url, peer_url = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        proc = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", os.path.join(work, "data"), "--listen-client-urls", client_url,
             "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls",
             peer_url, "--initial-cluster", f"bench={peer_url}", "--log-level", "error", "--logger", "zap"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        endpoint = client_url[len("http://"):]
        client = EtcdClient([endpoint], timeout=1.0)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.get(b"/ready")
                    break
                except EtcdError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            yield endpoint
        finally:
            client.close()
            proc.terminate()
            proc.wait(10)


def _coordinator(*flags: str, port: int = 0) -> tuple[str, subprocess.Popen[bytes]]:
    port = port or _free_port()
    proc = subprocess.Popen([*AXOND, "coordinator", "--host", "127.0.0.1", "--port", str(port), "--token", TOKEN,
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"127.0.0.1:{port}", proc


def _serving(address: str, timeout: float = 30.0) -> None:
    with connect(address, token=TOKEN, call_timeout=timeout, connect_wait=timeout) as c:
        c.get_status()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def failover(endpoint: str, ttl: int, kills: int, sig: signal.Signals) -> list[float]:
    """Seconds from signalling the leader to the first successful KvSet after it, `kills` times."""
    url = f"etcd://{endpoint}/bench-failover-{ttl}-{sig.name}-{time.monotonic_ns()}"
    flags = ("--state", url, "--leader-ttl", str(ttl))
    replicas = dict(_coordinator(*flags) for _ in range(2))
    times: list[float] = []
    try:
        addresses = ",".join(replicas)
        with connect(addresses, token=TOKEN, call_timeout=60.0) as client:
            node = client.register_node("bench").node_id
            store = client.store("failover", client.join("failover", node, 1, 1, 1, timeout=30.0).generation)
            for i in range(kills):
                store.set("warm", b"1")
                leader = client.active_address
                replicas[leader].send_signal(sig)
                t0 = time.perf_counter()
                while True:  # a clean stop may still answer a call or two before it hands over
                    store.set(f"after/{i}", b"1")
                    if client.active_address != leader:
                        break
                times.append(time.perf_counter() - t0)
                replicas[leader].wait(15)
                replicas[leader] = _coordinator(*flags, port=int(leader.rpartition(":")[2]))[1]
                time.sleep(1.0)
    finally:
        _stop(list(replicas.values()))
    return times


Row = tuple[float, float, float, int]


def kv(endpoint: str, clients: list[int], procs: int, seconds: float, rounds: int) -> dict[tuple[str, int], list[Row]]:
    """(ops/s, p50 ms, p99 ms, failed calls) per (state, clients), one per round."""
    got: dict[tuple[str, int], list[Row]] = {}
    for _ in range(rounds):
        for store in ("sqlite", "etcd"):
            with tempfile.TemporaryDirectory(prefix="axond-bench-state-") as state_dir:
                flags = ("--state-dir", state_dir) if store == "sqlite" else (
                    "--state", f"etcd://{endpoint}/bench-kv-{time.monotonic_ns()}")
                flags += ("--heartbeat-interval", "60")  # the load's node does not heartbeat
                address, proc = _coordinator(*flags)
                try:
                    _serving(address)
                    for n in clients:
                        rate, p50, p99, failed = rendezvous._kv_load(address, n, min(procs, n), seconds, "mixed", 1 << 20)
                        got.setdefault((store, n), []).append((rate, p50, p99, failed))
                finally:
                    _stop([proc])
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["failover", "kv", "all"], default="all")
    parser.add_argument("--ttls", default="2,3", help="(failover) comma-separated leader lease TTLs in seconds")
    parser.add_argument("--kills", type=int, default=3, help="(failover) leader kills per TTL and signal")
    parser.add_argument("--clients", default="10,100", help="(kv) comma-separated concurrent client counts")
    parser.add_argument("--client-procs", type=int, default=2, help="(kv) processes the clients are spread over")
    parser.add_argument("--kv-seconds", type=float, default=4.0, help="(kv) measured seconds per row")
    parser.add_argument("--kv-rounds", type=int, default=2, help="(kv) interleaved rounds (median reported)")
    args = parser.parse_args(argv)
    with _etcd() as endpoint:
        if args.part in ("failover", "all"):
            print(f"## Failover: leader signalled -> first successful KvSet (2 replicas, etcd {endpoint}, "
                  f"{args.kills} kills per row)\n")
            print("| signal | leader TTL s | min s | median s | max s |")
            print("|---|---:|---:|---:|---:|")
            for sig in (signal.SIGKILL, signal.SIGTERM):
                for ttl in (int(t) for t in args.ttls.split(",")):
                    t = failover(endpoint, ttl, args.kills, sig)
                    print(f"| {sig.name} | {ttl} | {min(t):.2f} | {statistics.median(t):.2f} | {max(t):.2f} |",
                          flush=True)
            print()
        if args.part in ("kv", "all"):
            clients = [int(c) for c in args.clients.split(",")]
            got = kv(endpoint, clients, args.client_procs, args.kv_seconds, args.kv_rounds)
            print(f"## KV over gRPC, mixed KvSet/KvGet, {args.client_procs} client processes, {args.kv_seconds:g} s "
                  f"per row, median of {args.kv_rounds} rounds ({os.cpu_count()} CPUs, etcd on the same machine)\n")
            print("| state | clients | ops/s | vs SQLite | p50 ms | p99 ms | failed calls |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for store in ("sqlite", "etcd"):
                for n in clients:
                    rows = got[(store, n)]
                    rate, p50, p99 = (statistics.median(r[i] for r in rows) for i in range(3))
                    base = statistics.median(r[0] for r in got[("sqlite", n)])
                    print(f"| {'SQLite' if store == 'sqlite' else 'etcd'} | {n} | {rate:,.0f} | {rate / base:.2f} | "
                          f"{p50:.1f} | {p99:.1f} | {int(sum(r[3] for r in rows))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
