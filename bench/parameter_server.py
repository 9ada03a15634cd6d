"""Parameter-server benchmark (not a test): a worker's step time under ParameterServer (sync and async)
against DDP on the same model, the same per-worker batch and the same number of gradient-computing ranks.

    python bench/parameter_server.py [--models 128x1 512x4] [--workers 2] [--servers 1] [--steps 40]

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes): DDP runs on
`workers` ranks, the parameter server on `servers + workers` ranks (the servers compute no gradients).
Reported: the median step time of the workers (forward, backward, push and pull / all-reduce, step).
Rows with more ranks than CPU cores measure contention as much as communication.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
from axond.nn import CrossEntropyLoss
from axond.nn.optim import SGD
from axond.parallel import DDP
from axond.parallel.ps import ParameterServer
from axond.testing import run_processes


def _sgd(params: Any) -> SGD:
    return SGD(list(params), lr=1e-4, momentum=0.9)


class _Rank:
    """Picklable per-rank entry point (spawned children import this module)."""

    def __init__(self, kind: str, hidden: int, depth: int, steps: int, batch: int, servers: int) -> None:
        self.kind, self.hidden, self.depth, self.steps, self.batch, self.servers = kind, hidden, depth, steps, batch, servers

    def __call__(self) -> dict[str, Any]:
        from axond.distributed import api

        group = api.default_group()
        cfg = replace(TrainConfig(), hidden=self.hidden, depth=self.depth, samples=max(4096, self.batch * 8))
        x, y, _, _ = make_dataset(cfg)
        model = build_model(cfg)
        loss = CrossEntropyLoss()
        times: list[float] = []
        if self.kind == "ddp":
            ddp, opt = DDP(model, group), _sgd(model.parameters())
            for i in range(self.steps):
                lo = (i * self.batch) % (len(x) - self.batch)
                t0 = time.perf_counter()
                opt.zero_grad()
                loss(ddp(x[lo:lo + self.batch]), y[lo:lo + self.batch])
                ddp.backward(loss.backward())
                opt.step()
                times.append(time.perf_counter() - t0)
        else:
            ps = ParameterServer(model, _sgd, group=group, num_servers=self.servers, mode=self.kind)  # type: ignore[arg-type]
            if ps.is_server:
                ps.serve(self.steps)
                return {"server": True}
            for i in range(self.steps):
                lo = (i * self.batch) % (len(x) - self.batch)
                t0 = time.perf_counter()
                model.zero_grad()
                loss(model(x[lo:lo + self.batch]), y[lo:lo + self.batch])
                model.backward(loss.backward())
                ps.step()
                times.append(time.perf_counter() - t0)
        warm = times[len(times) // 4:]
        return {"server": False, "median": float(np.median(warm)),
                "params": sum(p.size for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["128x1", "512x4"], help="HIDDENxDEPTH of the example MLP")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    print(f"## ParameterServer vs DDP: {a.workers} workers (+{a.servers} server(s)), batch {a.batch_size} per worker, "
          f"{os.cpu_count()} CPUs\n")
    print("| model | params | DDP step ms | PS sync step ms | PS async step ms | sync / DDP | async / DDP |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in a.models:
        hidden, depth = (int(v) for v in spec.split("x"))
        row: dict[str, float] = {}
        params = 0
        for kind, world in (("ddp", a.workers), ("sync", a.servers + a.workers), ("async", a.servers + a.workers)):
            res = run_processes(_Rank(kind, hidden, depth, a.steps, a.batch_size, a.servers), world, timeout=600)
            workers = [r for r in res if not r["server"]]
            row[kind] = 1e3 * float(np.median([r["median"] for r in workers]))
            params = workers[0]["params"]
        print(f"| {spec} | {params:,} | {row['ddp']:.2f} | {row['sync']:.2f} | {row['async']:.2f} | "
              f"{row['sync'] / row['ddp']:.2f}x | {row['async'] / row['ddp']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
