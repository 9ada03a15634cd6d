"""`bench/collectives.py --hosts N`: the collectives between network-namespace hosts (axond/testing/netns.py).

Each host is a network namespace with its own veth address on one bridge, so the ranks of different hosts
talk over the veth links at the addresses they advertise, as between machines (the links cost the same
kernel copies as loopback: this measures the software, not a NIC). Ranks r*K .. r*K+K-1 run in host r
(`--ranks-per-host K`; `K0 K1 ...`: so many in each host, hosts of different sizes); members of a host share its
address and, by default, its memory. In the same run:
axond with AXOND_SHM=0 as peer "sockets" (when K > 1), gloo when torch imports, and the raw limit: two
processes in hosts 0 and 1 streaming through plain sockets both ways at once over the veth link.

Rank processes start this file in their host: `collectives_hosts.py rank SPEC_JSON`, and the raw peers
`collectives_hosts.py raw ROLE ADDR PORT NBYTES CHUNK` (ROLE: serve or connect).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bounds import add_rate
from collectives import (
    Result, _duplex, _importable, best, fmt_size, report, report_bound, report_raw, run_suite,
)

HERE = os.path.abspath(__file__)
RAW_PEAK_BYTES = 1 << 30


def _env(**extra: str) -> dict[str, str]:
    """The explicit environment of processes in the hosts (this interpreter's, plus `extra`)."""
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "OMP_NUM_THREADS")
    axond = {k: v for k, v in os.environ.items() if k.startswith("AXOND_")}  # the run's settings reach its ranks
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **axond, "PYTHONUNBUFFERED": "1", **extra}


def _finish(procs: list[subprocess.Popen[str]], timeout: float, what: str) -> list[str]:
    """Outputs of `procs` once all exited 0; raises RuntimeError with the failing output otherwise."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"{what}: a process exited with code {p.returncode}:\n{out[-3000:]}")
            outs.append(out)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{what}: did not finish in {timeout} s") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return outs


def raw_between(a: Any, b: Any, nbytes: int, chunk: int, timeout: float = 120.0) -> float:
    """GB/s per direction of a process in host `a` and one in host `b` streaming both ways at once."""
    port = "29400"
    serve = a.popen([sys.executable, HERE, "raw", "serve", a.addr, port, str(nbytes), str(chunk)], env=_env(),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conn = b.popen([sys.executable, HERE, "raw", "connect", a.addr, port, str(nbytes), str(chunk)], env=_env(),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = [float(out.split()[-1]) for out in _finish([serve, conn], timeout, "raw socket test")]
    return nbytes / max(secs) / 1e9


def _raw_role(role: str, addr: str, port: int, nbytes: int, chunk: int) -> None:
    if role == "serve":
        with socket.create_server((addr, port)) as listener:
            listener.settimeout(30)
            sock, _ = listener.accept()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection((addr, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.settimeout(120)
    with sock:
        print(_duplex(sock, nbytes, chunk))


def places(layout: list[int]) -> list[tuple[int, int]]:
    """(host, local rank) of each rank: ranks of host 0 first, then host 1's, ... (`layout`: ranks per host)."""
    return [(h, i) for h, k in enumerate(layout) for i in range(k)]


def run_ranks(net: Any, layout: list[int], library: str, op: str, sizes: list[int], backend: str, shm: bool,
              timeout: float, fresh: bool = False) -> Result:
    """One launch of every rank over the hosts (`library`: axond or gloo; `layout`: ranks per host) timing `op`;
    rank 0's results."""
    where = places(layout)
    n = len(where)
    with tempfile.TemporaryDirectory(prefix="axond-bench-hosts-") as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for r, (h, local) in enumerate(where):
            host = net.hosts[h]
            spec = {"library": library, "rank": r, "n": n, "local_rank": local, "addr": host.addr,
                    "master": net.hosts[0].addr, "store": tmp, "backend": backend, "op": op, "sizes": sizes,
                    "out": out, "fresh": fresh}
            env = _env(GLOO_SOCKET_IFNAME=host.ifname, **({} if shm else {"AXOND_SHM": "0"}),
                       **({"OMP_NUM_THREADS": "1"} if max(layout) > 1 else {}))
            procs.append(host.popen([sys.executable, HERE, "rank", json.dumps(spec)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        _finish(procs, timeout, f"{library} {op} on {n} ranks")
        with open(out) as f:
            raw = json.load(f)
    return {o: {int(k): (v[0], v[1]) for k, v in d.items()} for o, d in raw.items()}


def _rank(spec: dict[str, Any]) -> None:
    """A rank in its host: join the group at the host's address, time the op, rank 0 writes the results."""
    if spec["library"] == "gloo":
        import torch.distributed as dist

        from collectives_runners import GlooRunner

        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}:29401", rank=spec["rank"],
                                world_size=spec["n"])
        try:
            res = run_suite(GlooRunner(), [spec["op"]], spec["sizes"], spec["fresh"])
        finally:
            dist.destroy_process_group()
    else:
        import axond
        from axond.store.file import FileStore
        from collectives_runners import AxondRunner

        axond.init_process_group(spec["backend"], 120.0, rank=spec["rank"], world_size=spec["n"],
                                 store=FileStore(spec["store"]), local_rank=spec["local_rank"], host=spec["addr"])
        try:
            res = run_suite(AxondRunner(spec["backend"]), [spec["op"]], spec["sizes"], spec["fresh"])
        finally:
            axond.destroy_process_group()
    if spec["rank"] == 0:
        with open(spec["out"], "w") as f:
            json.dump(res, f)


def run_hosts(args: argparse.Namespace, sizes: list[int]) -> None:
    """The whole `--hosts` run: raw limit between hosts 0 and 1, then each op on axond and its peers, and the tables."""
    from axond.testing.netns import Network, unavailable

    reason = unavailable()
    if reason:
        sys.exit(f"--hosts needs network namespaces: {reason}")
    layout = args.ranks_per_host * args.hosts if len(args.ranks_per_host) == 1 else list(args.ranks_per_host)
    n = sum(layout)
    gloo = "gloo" in args.peers and _importable("torch.distributed")
    with Network.create(args.hosts, mtu=args.mtu) as net:
        print(f"# {args.hosts} namespace hosts ({', '.join(h.addr for h in net.hosts)}), MTU {args.mtu}, "
              f"ranks per host {' + '.join(map(str, layout))}"
              + ("" if gloo else "; gloo: torch is not installed, axond only"))
        raw, raw_sized = 0.0, {}
        ours: Result | None = None
        peers: dict[str, Result | None] = {}
        for _ in range(args.repeat):
            if not args.no_raw:
                a, b = net.hosts[0], net.hosts[1]
                raw = max(raw, raw_between(a, b, RAW_PEAK_BYTES, 4 << 20))
                for size in (s for s in sizes if s >= 1 << 20):
                    got = raw_between(a, b, size * max(4, (256 << 20) // size), size)
                    raw_sized[size] = max(raw_sized.get(size, 0.0), got)
            for op in args.ops:
                ours = best(ours, run_ranks(net, layout, "axond", op, sizes, args.backend, True, args.timeout,
                                            args.fresh_inputs))
                if max(layout) > 1 and "sockets" in args.peers:
                    peers["sockets"] = best(peers.get("sockets"), run_ranks(
                        net, layout, "axond", op, sizes, args.backend, False, args.timeout, args.fresh_inputs))
                if gloo:
                    peers["gloo"] = best(peers.get("gloo"), run_ranks(
                        net, layout, "gloo", op, sizes, args.backend, True, args.timeout, args.fresh_inputs))
    assert ours is not None
    report(n, ours, peers, raw or None)
    if raw:
        print(f"(raw: one process in host 0 and one in host 1 through plain sockets over the veth link; "
              f"streaming arrays of each size >= 1 MiB: {', '.join(f'{fmt_size(s)} {g:.2f}' for s, g in raw_sized.items())} GB/s)")
    if n == 2 and raw:
        report_raw(ours, raw, raw_sized)
    if raw and raw_sized:
        adds = {size: add_rate(size) for size in raw_sized}
        report_bound(n, ours, peers, {size: max(raw, gbs) for size, gbs in raw_sized.items()}, adds)


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        _rank(json.loads(sys.argv[2]))
    elif sys.argv[1] == "raw":
        _raw_role(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit(f"usage: {sys.argv[0]} rank SPEC_JSON | raw serve|connect ADDR PORT NBYTES CHUNK "
                 "(started by bench/collectives.py --hosts)")
