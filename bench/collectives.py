"""nccl-tests-style benchmark of axond's collectives, with gloo/MPI (if installed) and the raw socket limit.

    python bench/collectives.py --nproc 2 4 [--ops all_reduce broadcast] [--min-bytes 8 --max-bytes 256M]

For each op and size: median time per call (max over ranks per iteration), algbw = bytes / time,
busbw as in nccl-tests (all_reduce: algbw*2(n-1)/n; all_gather, reduce_scatter: algbw*(n-1)/n;
broadcast: algbw), and a correctness check. When torch (gloo) or mpi4py (+ mpirun) import, the
same sizes run on them in the same run (alternating per op) and the ratio axond/peer of busbw is
printed. Peer "sockets" is axond itself with AXOND_SHM=0: every byte through the sockets, as between
hosts, where the default moves large ops of same-host ranks through shared memory (the column
axond/sockets is that path's gain; gloo, and MPI with `--mca btl tcp,self`, use sockets on one host
too). The raw limit is two processes streaming through plain sockets in both directions at once:
its peak (one cache-resident 4 MiB buffer each way) and, for sizes >= 1 MiB, streaming arrays of that size.
`--mpi-btl vader,self` runs MPI over its shared-memory transport instead, the peer of axond's defaults.
`--fresh-inputs` has every rank write its input with new values before each call (untimed), as a training step
does: otherwise a library that reads a peer's buffer in place finds the unchanged buffer in its own cache after the
first call, and axond's mailbox skips writing the blocks its slot already holds.
`--hosts 2 [--ranks-per-host K | K0 K1]` runs between network-namespace hosts instead (root; bench/collectives_hosts.py).
`--busy K` runs K busy loops (processes spinning in `while True: pass`, unpinned) for the whole measurement, beside
every library alike: a machine whose cores other work also wants (data loaders, logging, other jobs).

When the ranks are at least as many as the cores, a last table per n gives each library's busbw as a
share of the host bound (bench/bounds.py): the busbw the machine's cores allow at the raw socket copy
rate plus the reductions' adds, whatever the algorithm. A ratio target beyond what the bound leaves over
a peer cannot be met over sockets on this machine (shared memory skips the socket copies and can pass it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bounds import add_rate, bus_factor, cores, host_bound
from collectives_runners import AxondRunner, GlooRunner, MpiRunner, Runner
from cross_core import probe

OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
Result = dict[str, dict[int, tuple[float, bool]]]
"""op -> size in bytes -> (median seconds, correct)."""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def sizes_between(low: int, high: int, factor: int) -> list[int]:
    if factor <= 0:
        fine = [n for n in (8, 64, 512, 4 << 10, 32 << 10) if low <= n <= high]
        return fine + sizes_between(256 << 10, high, 4)[: None if high >= 256 << 10 else 0]
    out, s = [], low
    while s <= high:
        out.append(s)
        s *= factor
    if out[-1] != high:
        out.append(high)
    return out


def iterations(nbytes: int) -> int:
    return max(5, min(200, (64 << 20) // max(nbytes, 1)))


def run_suite(runner: Runner, ops: list[str], sizes: list[int], fresh: bool = False) -> Result:
    """Time every op and size; the same on every rank (all ranks must agree on the loop). `fresh`: each rank writes
    its input before every call, outside the timed part (`Runner.touch`)."""
    results: Result = {}
    for op in ops:
        results[op] = {}
        for nbytes in sizes:
            try:
                call, check = runner.prepare(op, nbytes)
            except RuntimeError:
                continue
            iters = iterations(nbytes)
            for _ in range(min(3, iters)):
                call()
            runner.barrier()
            times = np.empty(iters)
            touch = runner.touch if fresh else None
            for i in range(iters):
                if touch is not None:
                    touch()
                t0 = time.perf_counter()
                call()
                times[i] = time.perf_counter() - t0
            worst = runner.max_times(times)
            ok = check()
            results[op][nbytes] = (float(np.median(worst)), ok)
    return results


def _axond_rank(rank: int, n: int, store_dir: str, backend: str, ops: list[str], sizes: list[int], shm: bool,
                nodes: int, q: Any, shared: bool = False, fresh: bool = False) -> None:
    if not shm:
        os.environ["AXOND_SHM"] = "0"  # sockets only, as between hosts
    import axond
    from axond.store.file import FileStore
    from axond.testing import node_hosts

    host = node_hosts(n, nodes)[rank] if nodes > 1 else None  # rank r on simulated node r % nodes
    axond.init_process_group(backend, 120.0, rank=rank, world_size=n, store=FileStore(store_dir),
                             local_rank=rank, host=host)  # one GPU per rank with --backend nccl
    try:
        res = run_suite(AxondRunner(backend, shared), ops, sizes, fresh)
    finally:
        axond.destroy_process_group()
    if rank == 0:
        q.put(res)


def _gloo_rank(rank: int, n: int, port: int, ops: list[str], sizes: list[int], q: Any, fresh: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        res = run_suite(GlooRunner(), ops, sizes, fresh)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        q.put(res)


def _spawn(target: Callable[..., None], n: int, args: tuple[Any, ...], timeout: float,
           **kwargs: Any) -> Result | None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, n, *args, q), kwargs=kwargs, daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                res: Result = q.get(timeout=0.5)
                return res
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise
    except Exception as e:  # noqa: BLE001 - a peer library's failure is reported and its column left empty
        print(f"  [{target.__name__} failed: {e!r}]", file=sys.stderr)
        return None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_mpi(n: int, ops: list[str], sizes: list[int], timeout: float, btl: str = "tcp,self",
            fresh: bool = False, backend: str = "") -> Result | None:
    """The suite under `mpirun -np n`: raw mpi4py, or axond's `backend` formed through MPI's rendezvous."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", btl, "-np", str(n),
               sys.executable, os.path.abspath(__file__), "--mpi-worker", out.name, "--ops", *ops,
               "--sizes", *map(str, sizes), *(["--fresh-inputs"] if fresh else []),
               *(["--backend", backend] if backend else [])]
        try:
            subprocess.run(cmd, check=True, timeout=timeout, capture_output=True)
        except (subprocess.SubprocessError, OSError) as e:
            print(f"  [mpi failed: {e}]", file=sys.stderr)
            return None
        raw = json.load(open(out.name))
    return {op: {int(k): (v[0], v[1]) for k, v in d.items()} for op, d in raw.items()}


def start_busy(k: int) -> list[subprocess.Popen[bytes]]:
    """K processes that spin on a core each for as long as they live (`--busy`), at the default priority."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range(k)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(10)


def raw_duplex(nbytes: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """GB/s per direction of two processes streaming through plain sockets in both directions at once."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    peer = ctx.Process(target=_raw_peer, args=(port, nbytes, chunk, q), daemon=True)
    peer.start()
    conn, _ = listener.accept()
    listener.close()
    secs = _duplex(conn, nbytes, chunk)
    peer_secs = q.get(timeout=120)
    peer.join(10)
    conn.close()
    return nbytes / max(secs, peer_secs) / 1e9


def _raw_peer(port: int, nbytes: int, chunk: int, q: Any) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    q.put(_duplex(sock, nbytes, chunk))
    sock.close()


def _duplex(sock: socket.socket, nbytes: int, chunk: int) -> float:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    out = memoryview(bytearray(b"\x01" * chunk))
    inp = memoryview(bytearray(chunk))

    def send() -> None:
        for _ in range(nbytes // chunk):
            sock.sendall(out)

    sock.sendall(b"go")
    got = sock.recv(2, socket.MSG_WAITALL)
    assert got == b"go"
    t0 = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    left = nbytes
    while left:
        left -= sock.recv_into(inp, min(chunk, left))
    sender.join()
    return time.perf_counter() - t0


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def report(n: int, ours: Result, peers: dict[str, Result | None], raw: float | None) -> None:
    print(f"\n## n = {n}" + (f"  (raw socket duplex limit: {raw:.2f} GB/s per direction)" if raw else ""))
    names = [k for k, v in peers.items() if v]
    head = "| op | size | axond time | algbw GB/s | busbw GB/s | ok |" + "".join(
        f" {k} time | {k} busbw | axond/{k} |" for k in names)
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    for op, by_size in ours.items():
        for nbytes, (secs, ok) in by_size.items():
            algbw = nbytes / secs / 1e9
            busbw = algbw * bus_factor(op, n)
            row = f"| {op} | {fmt_size(nbytes)} | {secs * 1e6:.1f} us | {algbw:.3f} | {busbw:.3f} | {'yes' if ok else 'NO'} |"
            for k in names:
                theirs = (peers[k] or {}).get(op, {}).get(nbytes)
                if theirs is None:
                    row += " n/a | n/a | n/a |"
                    continue
                tb = nbytes / theirs[0] / 1e9 * bus_factor(op, n)
                row += f" {theirs[0] * 1e6:.1f} us | {tb:.3f} | {theirs[0] / secs:.2f}x |"
            print(row)


def raw_at_sizes(sizes: list[int]) -> dict[int, float]:
    """The raw duplex limit when streaming arrays of each size (>= 1 MiB) rather than one cache-resident 4 MiB buffer."""
    return {size: raw_duplex(size * max(4, (256 << 20) // size), size) for size in sizes if size >= 1 << 20}


def report_raw(ours: Result, raw: float, raw_sized: dict[int, float]) -> None:
    """n = 2 all_reduce busbw against the raw limits: the peak (4 MiB buffer) and streaming an array of that size."""
    by_size = ours.get("all_reduce", {})
    rows = [(nbytes, secs) for nbytes, (secs, _) in by_size.items() if nbytes in raw_sized]
    if not rows:
        return
    print("\n### n = 2 all_reduce against the raw socket limit (GB/s per direction)")
    print("| size | axond busbw | raw peak (4 MiB buffer) | % of peak | raw streaming arrays of this size | % of that |")
    print("|---|---|---|---|---|---|")
    for nbytes, secs in rows:
        busbw = nbytes / secs / 1e9
        at = raw_sized[nbytes]
        print(f"| {fmt_size(nbytes)} | {busbw:.3f} | {raw:.2f} | {100 * busbw / raw:.0f} % | {at:.2f} | "
              f"{100 * busbw / at:.0f} % |")


def report_bound(n: int, ours: Result, peers: dict[str, Result | None], raw_sized: dict[int, float],
                 adds: dict[int, float]) -> None:
    """Each library's busbw as a share of the host bound, for sizes >= 1 MiB (when the ranks fill the cores)."""
    ncores = cores()
    names = [k for k, v in peers.items() if v]
    rows = []
    for op, by_size in ours.items():
        for nbytes, (secs, _) in by_size.items():
            bound = host_bound(op, n, nbytes, raw_sized.get(nbytes, 0.0), adds.get(nbytes), ncores)
            if bound is None:
                continue
            cells = [100 * nbytes / secs / 1e9 * bus_factor(op, n) / bound]
            for k in names:
                theirs = (peers[k] or {}).get(op, {}).get(nbytes)
                cells.append(100 * nbytes / theirs[0] / 1e9 * bus_factor(op, n) / bound if theirs else float("nan"))
            rows.append(f"| {op} | {fmt_size(nbytes)} | {bound:.3f} | " + " | ".join(f"{c:.0f} %" for c in cells) + " |")
    if not rows:
        return
    print(f"\n### n = {n} against the host bound ({n} ranks on {ncores} cores; the best raw copy rate of "
          "the run plus the adds, bench/bounds.py)")
    cols = ["op", "size", "bound busbw GB/s", "axond", *names]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join(["---"] * len(cols)) + "|")
    for row in rows:
        print(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=0, help="size step (nccl-tests -f); 0: 8 B, then x8 to 32 KiB, x4 to the max")
    ap.add_argument("--sizes", nargs="+", type=int, help="explicit sizes in bytes")
    ap.add_argument("--backend", default="tcp", help="axond backend: tcp, nccl, auto, or mpi (its ranks under mpirun "
                                                     "with --mpi-btl, beside raw mpi4py with --peers mpi)")
    ap.add_argument("--peers", nargs="*", default=["sockets", "gloo", "mpi"],
                    help="peers to compare with, when installed (sockets: axond itself with AXOND_SHM=0)")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw socket limit")
    ap.add_argument("--nodes", type=int, default=1,
                    help="axond only: put rank r on simulated node r %% NODES (its own loopback address, 127.0.0.x), "
                         "so a group over several nodes all-reduces in two levels (sockets: flat, over the sockets)")
    ap.add_argument("--hosts", type=int, default=0,
                    help="run between this many network-namespace hosts (root; bench/collectives_hosts.py) "
                         "instead of on loopback; --nproc is then ignored")
    ap.add_argument("--ranks-per-host", type=int, nargs="+", default=[1],
                    help="with --hosts: ranks in each host, or one count per host (2 1: hosts of different sizes)")
    ap.add_argument("--mtu", type=int, default=1500, help="with --hosts: MTU of the hosts' links (1500, 9000)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run everything this many times, libraries alternating per op, and keep each best median")
    ap.add_argument("--mpi-btl", default="tcp,self",
                    help="OpenMPI's transports (--mca btl): tcp,self (sockets, the default), or vader,self to compare "
                         "axond's shared memory with MPI's")
    ap.add_argument("--shared-arrays", action="store_true",
                    help="axond's buffers come from axond.shared_empty (the single-copy path then reads peers' "
                         "buffers with plain copies); the sockets peer keeps NumPy's")
    ap.add_argument("--fresh-inputs", action="store_true",
                    help="every rank writes its input with new values before each call, outside the timed part, "
                         "as a training "
                         "step's compute does (else the same unchanged buffers go round, which a peer that reads "
                         "another rank's buffer in place finds in its own cache after the first call)")
    ap.add_argument("--busy", type=int, default=0,
                    help="run this many busy loops (one process each, `while True: pass`) beside every library for "
                         "the whole measurement")
    ap.add_argument("--json", help="also write axond's results here: {n: {op: {size: [median seconds, correct]}}}")
    ap.add_argument("--mpi-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = args.sizes or sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    if args.mpi_worker:
        if args.backend != "tcp":  # axond's own backend ("mpi"), its group formed through MPI: no store to give
            import axond

            axond.init_process_group(args.backend, 120.0)
            runner: Runner = AxondRunner(args.backend)
        else:
            runner = MpiRunner()
        res = run_suite(runner, args.ops, sizes, args.fresh_inputs)
        if runner.rank == 0:
            with open(args.mpi_worker, "w") as f:
                json.dump(res, f)
        return
    if args.hosts:
        if args.hosts < 2 or min(args.ranks_per_host) < 1 or len(args.ranks_per_host) not in (1, args.hosts):
            ap.error(f"--hosts needs at least 2 hosts and --ranks-per-host one count of at least 1, or one per host "
                     f"(got {args.hosts}, {args.ranks_per_host})")
        from collectives_hosts import run_hosts

        run_hosts(args, sizes)
        return
    if "mpi" in args.peers:
        print(f"(MPI runs with --mca btl {args.mpi_btl})")
    busy = start_busy(args.busy)
    if busy:
        print(f"({args.busy} busy loop{'s' if args.busy > 1 else ''} beside every library for the whole run)")
    try:
        measure(args, sizes)
    finally:
        stop_busy(busy)


def measure(args: argparse.Namespace, sizes: list[int]) -> None:
    """Every library at every n, as `main` was asked."""
    raw: float | None = None
    raw_sized: dict[int, float] = {}
    results: dict[int, Result] = {}
    for n in args.nproc:
        ours: Result | None = None
        peers: dict[str, Result | None] = {}
        probes: list[tuple[str, float | None]] = []  # the cross-core probe before each run (bench/cross_core.py)
        for _ in range(args.repeat):
            if not args.no_raw:  # measured again each round, between the libraries: the best of all rounds counts
                raw = max(raw or 0.0, raw_duplex())
                for size, gbs in raw_at_sizes(sizes).items():
                    raw_sized[size] = max(raw_sized.get(size, 0.0), gbs)
            for op in args.ops:
                probes.append((f"axond {op}", probe(0.3)))
                if args.backend == "mpi":  # its ranks are an MPI job's, under the same btl as the raw MPI peer
                    got = run_mpi(n, [op], sizes, args.timeout, args.mpi_btl, args.fresh_inputs, "mpi")
                else:
                    with tempfile.TemporaryDirectory(prefix="axond-bench-") as store_dir:
                        got = _spawn(_axond_rank, n, (store_dir, args.backend, [op], sizes, True, args.nodes),
                                     args.timeout, shared=args.shared_arrays, fresh=args.fresh_inputs)
                if got is None:
                    sys.exit(f"axond benchmark failed at n = {n}")
                ours = best(ours, got)
                if "sockets" in args.peers and args.backend == "tcp":
                    with tempfile.TemporaryDirectory(prefix="axond-bench-") as store_dir:
                        peers["sockets"] = best(peers.get("sockets"), _spawn(
                            _axond_rank, n, (store_dir, args.backend, [op], sizes, False, args.nodes), args.timeout,
                            fresh=args.fresh_inputs))
                if "gloo" in args.peers and _importable("torch.distributed"):
                    probes.append((f"gloo {op}", probe(0.3)))
                    peers["gloo"] = best(peers.get("gloo"), _spawn(_gloo_rank, n, (free_port(), [op], sizes), args.timeout,
                                                                      fresh=args.fresh_inputs))
                if "mpi" in args.peers and _importable("mpi4py"):
                    probes.append((f"mpi {op}", probe(0.3)))
                    peers["mpi"] = best(peers.get("mpi"), run_mpi(n, [op], sizes, args.timeout, args.mpi_btl,
                                                                    args.fresh_inputs))
        assert ours is not None
        results[n] = ours
        report(n, ours, peers, raw if n == 2 else None)
        if n == 2 and raw is not None:
            report_raw(ours, raw, raw_sized)
        if raw is not None:
            adds = {size: add_rate(size) for size in raw_sized}
            report_bound(n, ours, peers, {size: max(raw, gbs) for size, gbs in raw_sized.items()}, adds)
        report_probes(probes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


def report_probes(probes: list[tuple[str, float | None]]) -> None:
    """The cross-core probe taken before each run: its range, and the runs it found the machine slow for (over
    twice the fastest probe: shared-memory cells of those runs are the machine's, not the library's)."""
    got = [(what, ms) for what, ms in probes if ms is not None]
    if not got:
        return
    fast = min(ms for _, ms in got)
    slow = [f"{what} ({ms:.2f} ms)" for what, ms in got if ms > 2 * fast]
    print(f"\ncross-core probe before each run (bench/cross_core.py): {fast:.2f}-{max(ms for _, ms in got):.2f} ms; "
          + (f"slow before: {', '.join(slow)}" if slow else "no slow stretch"))


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def best(a: Result | None, b: Result | None) -> Result | None:
    """Merge two runs keeping the faster median per op and size (repeats tame a shared machine's noise)."""
    if a is None or b is None:
        return a or b
    out: Result = {op: dict(d) for op, d in a.items()}
    for op, by_size in b.items():
        for nbytes, (secs, ok) in by_size.items():
            prev = out.setdefault(op, {}).get(nbytes)
            out[op][nbytes] = (secs, ok and (prev is None or prev[1])) if prev is None or secs < prev[0] else (
                prev[0], prev[1] and ok)
    return out


if __name__ == "__main__":
    main()
