"""Sharding benchmark (not a test): memory per rank and step time of DDP, ZeRO-1 and FSDP on the same model.

    python bench/sharding.py [--model 1024x4] [--worlds 2 4] [--steps 20] [--batch-size 64]

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes), one BLAS
thread each, training the example MLP (`HIDDENxDEPTH`, float32) with AdamW. Memory is what NumPy
allocated, as traced by `tracemalloc` (NumPy reports its buffers to it), after the data set was
built: "state" is what stays allocated between steps (parameters, gradients, optimizer state,
gathered buffers kept around), "peak" the most allocated at once during a step. Modes:
- ddp: DDP + AdamW (everything replicated);
- zero1: DDP + ZeroRedundancyOptimizer(AdamW) (optimizer state sharded);
- fsdp-no-shard / fsdp-grad-op / fsdp-full: FSDP with NO_SHARD, SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3),
  the model as one unit;
- fsdp-full-layers / fsdp-full-layers-prefetch: FULL_SHARD with one unit per Linear, without and with
  forward_prefetch + backward_prefetch (the next unit's all_gather and the last one's reduce_scatter run
  on the comm thread while this unit computes).
Rows with more ranks than cores are labelled "oversubscribed". The last two columns are the wrapper's own
accounting (`memory_stats()`: parameters, gradients, optimizer state and its transient buffers, not activations
or the optimizer's temporaries that tracemalloc also sees) and `memory_estimate`'s prediction of it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from dataclasses import replace
from typing import Any

import numpy as np

from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
from axond.nn import CrossEntropyLoss, Linear
from axond.nn.optim import AdamW
from axond.parallel import DDP, FSDP, ShardingStrategy, ZeroRedundancyOptimizer, memory_estimate
from axond.testing import run_processes

MODES = ["ddp", "zero1", "fsdp-no-shard", "fsdp-grad-op", "fsdp-full", "fsdp-full-layers", "fsdp-full-layers-prefetch"]
STRATEGIES = {"fsdp-no-shard": ShardingStrategy.NO_SHARD, "fsdp-grad-op": ShardingStrategy.SHARD_GRAD_OP,
              "fsdp-full": ShardingStrategy.FULL_SHARD, "fsdp-full-layers": ShardingStrategy.FULL_SHARD,
              "fsdp-full-layers-prefetch": ShardingStrategy.FULL_SHARD}
ESTIMATED = {"ddp": "ddp", "fsdp-grad-op": "shard_grad_op", "fsdp-full": "fsdp", "fsdp-full-layers": "fsdp"}
"""Modes `memory_estimate` predicts, by its strategy name: not NO_SHARD or prefetching, and not zero1 here (the
estimate's "zero1" reduces the gradients itself; this bench runs ZeroRedundancyOptimizer behind DDP)."""


def rank_main(mode: str, hidden: int, depth: int, steps: int, batch: int) -> dict[str, Any]:
    """One rank of one mode: traced NumPy memory between and during steps, and the median step time."""
    import axond
    from axond.distributed import api

    group = api.default_group()
    cfg = replace(TrainConfig(), hidden=hidden, depth=depth, samples=batch * 8)
    x, y, _, _ = make_dataset(cfg)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    model = build_model(cfg)
    params = sum(p.size for p in model.parameters())
    if mode in STRATEGIES:
        prefetch = mode.endswith("-prefetch")
        wrapper: Any = FSDP(model, group, sharding_strategy=STRATEGIES[mode],
                            wrap=(lambda m: isinstance(m, Linear)) if "-layers" in mode else None,
                            forward_prefetch=prefetch, backward_prefetch=prefetch)
        opt: Any = AdamW(list(wrapper.parameters()), lr=1e-4)
    else:
        wrapper = DDP(model, group)
        opt = (ZeroRedundancyOptimizer(list(model.parameters()), AdamW, group, lr=1e-4) if mode == "zero1"
               else AdamW(list(model.parameters()), lr=1e-4))
    loss = CrossEntropyLoss()
    times, peaks, states = [], [], []
    for i in range(steps):
        lo = (i * batch) % (len(x) - batch)
        axond.barrier(group)
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss(wrapper(x[lo : lo + batch]), y[lo : lo + batch])
        wrapper.backward(loss.backward())
        opt.step()
        times.append(time.perf_counter() - t0)
        current, peak = tracemalloc.get_traced_memory()
        peaks.append(peak - base)
        states.append(current - base)
    tracemalloc.stop()
    warm = max(1, steps // 4)
    own = opt.memory_stats() if mode == "zero1" else wrapper.memory_stats(opt)
    return {"params": params, "state": max(states[warm:]), "peak": max(peaks[warm:]),
            "step": float(np.median(times[warm:])), "stats": own}


class _Rank:
    """Picklable per-rank entry point for run_processes (spawned children import this module)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __call__(self) -> dict[str, Any]:
        return rank_main(*self.args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1024x4", help="HIDDENxDEPTH of the example MLP")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    a = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    hidden, depth = (int(v) for v in a.model.split("x"))
    cores = os.cpu_count() or 1
    print(f"model {a.model} (float32, AdamW); per-rank batch {a.batch_size}; {a.steps} steps, median after warm-up; "
          f"NumPy memory per rank (tracemalloc), the largest rank\n")
    print("| mode | ranks | params | state MiB | vs ddp | peak in step MiB | step ms | samples/s "
          "| stats current / peak MiB | estimate current / peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in a.worlds:
        ddp_state = None
        for mode in a.modes:
            res = run_processes(_Rank(mode, hidden, depth, a.steps, a.batch_size), world, timeout=900)
            state = max(r["state"] for r in res) / 2**20
            peak = max(r["peak"] for r in res) / 2**20
            step = max(r["step"] for r in res)
            ddp_state = state if mode == "ddp" else ddp_state
            ratio = f"{state / ddp_state:.2f}x" if ddp_state else "n/a"
            label = f"{world} (oversubscribed)" if world > cores else str(world)
            own = max((r["stats"] for r in res), key=lambda st: st["peak"])
            est = "n/a"
            if mode in ESTIMATED:
                model = build_model(replace(TrainConfig(), hidden=hidden, depth=depth))
                e = memory_estimate(model, ESTIMATED[mode], world,
                                    wrap=(lambda m: isinstance(m, Linear)) if "-layers" in mode else None)
                est = f"{e['current'] / 2**20:.1f} / {e['peak'] / 2**20:.1f}"
            print(f"| {mode} | {label} | {res[0]['params']:,} | {state:.1f} | {ratio} | {peak:.1f} | {step * 1e3:.1f} | "
                  f"{world * a.batch_size / step:,.0f} | {own['current'] / 2**20:.1f} / {own['peak'] / 2**20:.1f} | "
                  f"{est} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
