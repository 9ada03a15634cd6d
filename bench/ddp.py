"""DDP benchmark (not a test): throughput of the example model on 1, 2 and 4 ranks, the share of
communication hidden behind backward, and DDP's cost over plain training on the same per-rank batch.

    python bench/ddp.py [--models 128x1 512x4] [--worlds 1 2 4] [--steps 60] [--batch-size 64] [--hook bf16]

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes). Rows with
more ranks than CPU cores are labelled "oversubscribed": they measure contention, not scaling.

Every rank uses one BLAS thread (OMP/OPENBLAS_NUM_THREADS=1 unless set): with OpenBLAS's default of
one busy-waiting thread per core, two ranks on two cores run ~100x slower than one.

Per rank and per configuration, after warm-up steps:
- local: forward + backward + step of the bare model (no communication);
- sync: DDP with GradSyncStrategy.SYNCHRONOUS (all buckets reduced after backward);
- overlap: DDP with GradSyncStrategy.OVERLAPPED (buckets reduced while backward runs).
hidden = (sync - overlap) / (sync - local): the fraction of the gradient communication that the
overlap removes from the step time (1.0 = all of it hidden, 0 = none; noisy when comm is tiny).
`--hook bf16|fp16|powersgd` reduces the buckets through `bf16_compress_hook`/`fp16_compress_hook`/`powerSGD_hook`
(rank 4, from the first step); "wire MB" is what each rank sends per step for the gradients: 2 (n - 1) / n of the
buckets' bytes in the dtype on the wire (PowerSGD: divided by its compression rate).
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
from axond.parallel import DDP, GradSyncStrategy
from axond.parallel.ddp import PowerSGDState, bf16_compress_hook, fp16_compress_hook, powerSGD_hook
from axond.testing import run_processes


class _Stepper:
    """One training configuration: a forward/backward/step runner over the shared data."""

    def __init__(self, model: Any, trainer: Any, x: np.ndarray, y: np.ndarray, batch: int) -> None:
        self.model, self.trainer, self.x, self.y, self.batch = model, trainer, x, y, batch
        self.loss = CrossEntropyLoss()
        self.opt = SGD(list(model.parameters()), lr=1e-4, momentum=0.9)
        self.i = 0

    def step(self) -> float:
        lo = (self.i * self.batch) % (len(self.x) - self.batch)
        self.i += 1
        t0 = time.perf_counter()
        self.opt.zero_grad()
        self.loss(self.trainer(self.x[lo : lo + self.batch]), self.y[lo : lo + self.batch])
        self.trainer.backward(self.loss.backward())
        self.opt.step()
        return time.perf_counter() - t0


HOOKS = {"none": (None, 4), "bf16": (bf16_compress_hook, 2), "fp16": (fp16_compress_hook, 2), "powersgd": (powerSGD_hook, 4)}
"""--hook: the communication hook and the bytes per gradient element on the wire (PowerSGD: divided by the
compression rate it reports)."""
POWERSGD_RANK = 4
"""--hook powersgd: the approximation rank (PowerSGD from the first step: the benchmark measures its cost)."""


def rank_main(hidden: int, depth: int, steps: int, batch: int, bucket_cap_mb: float, hook: str = "none") -> dict[str, Any]:
    """One rank: step times of local, synchronous and overlapped training, interleaved in rounds.

    Interleaving (a few steps of each mode per round) and keeping the best round's median make
    the comparison robust to other load on the machine drifting during the run.
    """
    import axond
    from axond.distributed import api

    group = api.default_group()
    cfg = replace(TrainConfig(), hidden=hidden, depth=depth, samples=max(4096, batch * 8))
    x, y, _, _ = make_dataset(cfg)
    model = build_model(cfg)
    # One model per mode: a DDP refuses steps after a backward that bypassed it, as another wrapper's would.
    sync = DDP(build_model(cfg), group, bucket_cap_mb=bucket_cap_mb, strategy=GradSyncStrategy.SYNCHRONOUS)
    overlap = DDP(build_model(cfg), group, bucket_cap_mb=bucket_cap_mb, strategy=GradSyncStrategy.OVERLAPPED)
    fn, width = HOOKS[hook]
    states = {}
    for ddp in (sync, overlap) if fn is not None else ():
        states[id(ddp)] = PowerSGDState(None, POWERSGD_RANK, start_powerSGD_iter=0) if hook == "powersgd" else None
        ddp.register_comm_hook(states[id(ddp)], fn)
    n = group.size
    modes = {
        "local": _Stepper(model, model, x, y, batch),
        "synchronous": _Stepper(sync.module, sync, x, y, batch),
        "overlapped": _Stepper(overlap.module, overlap, x, y, batch),
    }
    per_round = 5
    best = {name: float("inf") for name in modes}
    for r in range(max(steps // per_round, 2) + 1):
        for name, stepper in modes.items():
            axond.barrier(group)
            times = [stepper.step() for _ in range(per_round)]
            if r > 0:
                best[name] = min(best[name], float(np.median(times)))
    state = states.get(id(overlap))
    rate = state.compression_stats()[0] if state is not None else 1.0
    wire = 2 * (n - 1) / n * sum(b.buffer.size for b in overlap.buckets) * width / rate
    return {"params": sum(p.size for p in model.parameters()), "buckets": len(overlap.buckets), "wire": wire, **best}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["128x1", "512x4"],
                   help="HIDDENxDEPTH of the example MLP; 128x1 is the example's default")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--hook", choices=sorted(HOOKS), default="none", help="DDP communication hook")
    a = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # one BLAS thread per rank (as torchrun does); spawned ranks inherit it
    cores = os.cpu_count() or 1
    print(f"CPU cores: {cores}; TCP backend on loopback; per-rank batch {a.batch_size}; bucket cap {a.bucket_cap_mb} MiB; "
          f"{a.steps} steps per mode, interleaved in rounds of 5, best round's median; hook {a.hook}\n")
    print("| model | params | ranks | buckets | samples/s (overlap) | step local ms | step sync ms | step overlap ms "
          "| comm hidden | DDP cost vs local | wire MB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in a.models:
        hidden, depth = (int(v) for v in model.split("x"))
        for world in a.worlds:
            res = run_processes(_Rank(hidden, depth, a.steps, a.batch_size, a.bucket_cap_mb, a.hook), world, timeout=600)
            slowest = {k: max(r[k] for r in res) for k in ("local", "synchronous", "overlapped")}
            comm = slowest["synchronous"] - slowest["local"]
            hidden_frac = (slowest["synchronous"] - slowest["overlapped"]) / comm if comm > 1e-5 and world > 1 else float("nan")
            cost = slowest["overlapped"] / slowest["local"] - 1.0
            label = f"{world} (oversubscribed)" if world > cores else str(world)
            rate = world * a.batch_size / slowest["overlapped"]
            print(f"| {model} | {res[0]['params']:,} | {label} | {res[0]['buckets']} | {rate:,.0f} | "
                  f"{slowest['local'] * 1e3:.2f} | {slowest['synchronous'] * 1e3:.2f} | {slowest['overlapped'] * 1e3:.2f} | "
                  f"{'n/a' if np.isnan(hidden_frac) else f'{hidden_frac:.0%}'} | {cost:+.0%} | {res[0]['wire'] / 1e6:.2f} |",
                  flush=True)
    return 0


class _Rank:
    """Picklable per-rank entry point for run_processes (spawned children import this module)."""

    def __init__(self, hidden: int, depth: int, steps: int, batch: int, bucket_cap_mb: float, hook: str) -> None:
        self.args = (hidden, depth, steps, batch, bucket_cap_mb, hook)

    def __call__(self) -> dict[str, Any]:
        return rank_main(*self.args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
