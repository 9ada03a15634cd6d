"""Replica digest benchmark (not a test): what `DistributedTrainer(digest_every=10)` adds to a DDP step.

    python bench/digest.py [--models 128x1 512x4 1024x8] [--world 2] [--rounds 30] [--every 10] [--batch-size 64]

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes), one BLAS thread each. Per
rank, after a warm-up round, rounds of `--every` DDP steps (forward, backward with the gradient all-reduce, SGD step)
alternate between off (no digest) and on (the steps, then `check_replicas`: the digest of every parameter and the
all-gather of one uint64 per rank, what the trainer runs every `digest_every` steps). Reported per model (slowest rank):
the median step time, the median time of one check, the check's share of `--every` steps (its cost), and the A/B of
the rounds' medians (on / off - 1: the same cost measured end to end, with the machine's noise in it).
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
from axond.testing import run_processes
from axond.train.digest import check_replicas


def rank_main(hidden: int, depth: int, rounds: int, every: int, batch: int) -> dict[str, Any]:
    import axond
    from axond.distributed import api

    group = api.default_group()
    cfg = replace(TrainConfig(), hidden=hidden, depth=depth, samples=max(4096, batch * 8))
    x, y, _, _ = make_dataset(cfg)
    ddp = DDP(build_model(cfg), group)
    params = list(ddp.module.parameters())
    loss, opt = CrossEntropyLoss(), SGD(params, lr=1e-4, momentum=0.9)
    i = 0

    def steps() -> list[float]:
        nonlocal i
        out = []
        for _ in range(every):
            lo = (i * batch) % (len(x) - batch)
            i += 1
            t0 = time.perf_counter()
            opt.zero_grad()
            loss(ddp(x[lo : lo + batch]), y[lo : lo + batch])
            ddp.backward(loss.backward())
            opt.step()
            out.append(time.perf_counter() - t0)
        return out

    step_times, checks, off, on = [], [], [], []
    for r in range(rounds + 1):
        for digest in (False, True):
            axond.barrier(group)
            t0 = time.perf_counter()
            times = steps()
            if digest:
                t1 = time.perf_counter()
                if check_replicas(params, group):
                    raise RuntimeError("replicas disagree in a fault-free run")
                checks.append(time.perf_counter() - t1)
            total = time.perf_counter() - t0
            if r > 0:
                (on if digest else off).append(total)
                step_times.extend(times)
    return {"params": sum(p.size for p in params), "step": float(np.median(step_times)),
            "check": float(np.median(checks[1:])), "off": float(np.median(off)), "on": float(np.median(on))}


class _Rank:
    """Picklable per-rank entry point for run_processes (spawned children import this module)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __call__(self) -> dict[str, Any]:
        return rank_main(*self.args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["128x1", "512x4", "1024x8"], help="HIDDENxDEPTH of the example MLP")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--every", type=int, default=10, help="digest_every: steps per round")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    a = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    print(f"CPU cores: {os.cpu_count()}; {a.world} ranks, TCP backend on loopback; per-rank batch {a.batch_size}; "
          f"{a.rounds} rounds of {a.every} steps off and on, alternating; medians, slowest rank\n")
    print("| model | params | MB | step ms | check ms | check / {0} steps | A/B rounds (on/off - 1) |".format(a.every))
    print("|---|---|---|---|---|---|---|")
    for model in a.models:
        hidden, depth = (int(v) for v in model.split("x"))
        res = run_processes(_Rank(hidden, depth, a.rounds, a.every, a.batch_size), a.world, timeout=600)
        worst = {k: max(r[k] for r in res) for k in ("step", "check", "off", "on")}
        share = worst["check"] / (a.every * worst["step"])
        print(f"| {model} | {res[0]['params']:,} | {res[0]['params'] * 4 / 1e6:.2f} | {worst['step'] * 1e3:.2f} | "
              f"{worst['check'] * 1e3:.3f} | {share:.3%} | {worst['on'] / worst['off'] - 1:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
