"""One training step of torch DDP and FSDP2 over the "axond" backend against gloo, same model, same processes.

Every rank joins "axond" as the default group and a gloo group over the same ranks; the two wrappers
alternate step by step (so both see the same machine load) and rank 0 reports the median step time,
then the median time of one small and one 1 MiB all_reduce through torch's API (alternating between the backends)
and of an 8-byte one back to back. For DDP it also times DDP's step without communication (`no_sync`): gloo's step
over that one is the most any backend's ratio could reach.
Run: `python bench/torch_ddp.py --nproc 2 4`; several `--width`s time one model each in the same run
(`--batch 1 --bucket-view --width 256 1024`: communication-bound); `--hosts 2` runs one rank in each of two network-namespace hosts
instead (root; both backends join `tcp://HOST0:PORT` as a gloo script would, so bytes cross the veth links).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cross_core import describe, probe


def build(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def wrap(kind: str, model: torch.nn.Module, group: Any, bucket_view: bool = False) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, process_group=group, gradient_as_bucket_view=bucket_view)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rank_main(rank: int, n: int, path: str, args: argparse.Namespace, q: Any) -> None:
    """One rank: `path` is a FileStore file, or `tcp://HOST:PORT` between hosts; rank 0 reports through `q.put`."""
    import axond.torch

    torch.set_num_threads(1)
    store = {} if path.startswith("tcp://") else {"store": dist.FileStore(path, n)}
    dist.init_process_group("axond", init_method=path if not store else None, rank=rank, world_size=n,
                            timeout=timedelta(seconds=120), **store)
    groups = {"axond": dist.group.WORLD, "gloo": dist.new_group(list(range(n)), backend="gloo")}
    for width, kind in [(w, k) for w in args.width for k in args.kinds]:
        torch.manual_seed(1)
        x, y = torch.randn(args.batch, width), torch.randn(args.batch, 1)
        models = {name: wrap(kind, build(width, args.depth), g, args.bucket_view) for name, g in groups.items()}
        if kind == "ddp":  # DDP's step without communication (no_sync): the floor of any backend's step
            models["floor"] = wrap(kind, build(width, args.depth), groups["axond"], args.bucket_view)
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
        times: dict[str, list[float]] = {name: [] for name in models}
        for step in range(args.warmup + args.steps):
            for name, model in models.items():
                g = groups.get(name, groups["axond"])
                dist.barrier(group=g)
                start = time.perf_counter()
                opts[name].zero_grad()
                with model.no_sync() if name == "floor" else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), y).backward()
                opts[name].step()
                dist.barrier(group=g)
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        if rank == 0:
            label = f"{kind} {args.depth}x{width}^2" if len(args.width) > 1 else kind
            q.put((label, n, {name: statistics.median(t) for name, t in times.items()}))
        del models, opts
    for nbytes in (8, 1 << 20):  # one all_reduce through torch's API: the per-op cost beside the step times
        t = torch.zeros(nbytes // 4)
        lat: dict[str, list[float]] = {name: [] for name in groups}
        for i in range(220):
            for name, g in groups.items():
                start = time.perf_counter()
                dist.all_reduce(t, group=g)
                if i >= 20:
                    lat[name].append(time.perf_counter() - start)
        if rank == 0:
            q.put((f"all_reduce {nbytes} B", n, {name: statistics.median(v) for name, v in lat.items()}))
    t = torch.zeros(2)  # then 8 bytes back to back, one backend at a time: a small op's cost alone
    alone: dict[str, float] = {}
    for name, g in groups.items():
        dist.barrier(group=g)
        calls = []
        for _ in range(2200):
            start = time.perf_counter()
            dist.all_reduce(t, group=g)
            calls.append(time.perf_counter() - start)
        alone[name] = statistics.median(calls[200:])
    if rank == 0:
        q.put(("all_reduce 8 B, back to back", n, alone))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kinds", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    p.add_argument("--width", type=int, nargs="+", default=[1024], help="one model per width, in the same run")
    p.add_argument("--depth", type=int, default=4, help="hidden layers of width x width (4: 4.2 M parameters)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True) for both backends: gradients live in DDP's buckets, no copies")
    p.add_argument("--hosts", type=int, default=0, help="one rank in each of this many network-namespace hosts (root)")
    p.add_argument("--rank-in-host", nargs=3, metavar=("RANK", "N", "INIT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_in_host:
        rank, n, init = args.rank_in_host
        rank_main(int(rank), int(n), init, args, _Printer())
        return
    params = ", ".join(f"{args.depth} x {w}^2: {sum(q.numel() for q in build(w, args.depth).parameters()) / 1e6:.1f} M"
                       for w in args.width)
    view = ", DDP gradient_as_bucket_view" if args.bucket_view else ""
    print(f"MLP ({params} parameters, float32), batch {args.batch} per rank, "
          f"median of {args.steps} steps after {args.warmup}, 1 thread per rank{view}")
    print(describe(probe()) + "\n")
    print("| wrapper or op | ranks | gloo | axond | gloo / axond | DDP without communication | gloo / that |")
    print("|---|---|---|---|---|---|---|")
    if args.hosts:
        _between_hosts(args)
        print("\n" + describe(probe()))
        return
    ctx = mp.get_context("spawn")
    for n in args.nproc:
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            procs = [ctx.Process(target=rank_main, args=(r, n, os.path.join(d, "store"), args, q)) for r in range(n)]
            for proc in procs:
                proc.start()
            for _ in range(len(args.kinds) * len(args.width) + 3):
                kind, size, t = _next_result(q, procs)
                _row(kind, size, t)
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    print("\n" + describe(probe()))


def _next_result(q: Any, procs: list[Any], timeout: float = 900.0) -> Any:
    """Rank 0's next report; exits at once, with the exit codes, if a rank has died instead of waiting it out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            return q.get(timeout=1.0)
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead:
            for proc in procs:
                proc.kill()
            sys.exit(f"a rank exited with code {dead[0]} (its traceback is above)")
    sys.exit(f"no result from rank 0 within {timeout:.0f} s")


def _row(kind: str, size: Any, t: dict[str, float]) -> None:
    """One line of the table; for DDP also its step without communication (`no_sync`: the same model's forward,
    backward, DDP hooks and optimizer step), and gloo's step over that: the most any backend's ratio could be."""
    floor = f"{t['floor'] * 1e3:.3f} ms | {t['gloo'] / t['floor']:.2f}x" if "floor" in t else "- | -"
    print(f"| {kind} | {size} | {t['gloo'] * 1e3:.3f} ms | {t['axond'] * 1e3:.3f} ms | {t['gloo'] / t['axond']:.2f}x "
          f"| {floor} |", flush=True)


class _Printer:
    """Rank 0's report channel in a host: one JSON line per result on stdout."""

    def put(self, item: Any) -> None:
        print("RESULT " + json.dumps(item), flush=True)


def _between_hosts(args: argparse.Namespace) -> None:
    """Every rank in its own namespace host (axond/testing/netns.py), joined over `tcp://` at host 0."""
    from axond.testing.netns import Network, unavailable

    reason = unavailable()
    if reason:
        sys.exit(f"--hosts needs network namespaces: {reason}")
    n = args.hosts
    passed = [f"--{k}={v}" for k, v in (("depth", args.depth), ("batch", args.batch), ("warmup", args.warmup),
                                        ("steps", args.steps))]
    passed += ["--width", *map(str, args.width)]
    passed += ["--bucket-view"] if args.bucket_view else []
    with Network.create(n) as net:
        init = f"tcp://{net.hosts[0].addr}:29611"
        procs = []
        for rank, host in enumerate(net.hosts):
            env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "PYTHONPATH") if k in os.environ}
            env.update(GLOO_SOCKET_IFNAME=host.ifname, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            argv = [sys.executable, os.path.abspath(__file__), "--kinds", *args.kinds, *passed,
                    "--rank-in-host", str(rank), str(n), init]
            procs.append(host.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                sys.exit(f"a rank exited with code {proc.returncode}:\n{out[-3000:]}")
            outs.append(out)
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            kind, size, t = json.loads(line[len("RESULT "):])
            _row(kind, f"{size} ({n} hosts)", t)


if __name__ == "__main__":
    main()
