"""A small native DDP job whose rank SLOW_RANK busy-waits SLOW_S seconds in each step's backward (a compute
straggler), for the straggler test and `bench/stragglers.py`:

    axond worker --standalone --nproc-per-node 4 -- python -m axond.testing.straggler_job STEPS

Rank 0 prints `step N` after each step. The native model has 8 hidden layers of 64 and 4 KiB buckets: 18
all_reduces per step.
`axond.testing.straggler_torch_job` is the same over torch DDP.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import axond
from axond.distributed import api
from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
from axond.nn import CrossEntropyLoss
from axond.nn.optim import SGD
from axond.parallel import DDP

OPS_PER_STEP = 18
"""The all_reduces of one step (one per bucket)."""


def busy(seconds: float) -> None:
    """Burn `seconds` of CPU (compute, not a sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def settings(argv: list[str]) -> tuple[int, int, float]:
    """(steps: the first argument, default 20; the slow rank: SLOW_RANK, default none; its delay: SLOW_S, 0.2 s)."""
    return int(argv[0]) if argv else 20, int(os.environ.get("SLOW_RANK", "-1")), float(os.environ.get("SLOW_S", "0.2"))


def main(argv: list[str]) -> int:
    steps, slow, delay = settings(argv)
    axond.init_process_group()
    group = api.default_group()
    cfg = replace(TrainConfig(), hidden=64, depth=8, samples=1024)
    x, y, _, _ = make_dataset(cfg)
    ddp = DDP(build_model(cfg), group, bucket_cap_mb=0.004)
    loss, opt = CrossEntropyLoss(), SGD(list(ddp.module.parameters()), lr=1e-3)
    batch = 32
    for i in range(steps):
        lo = (i * batch) % (len(x) - batch)
        opt.zero_grad()
        loss(ddp(x[lo:lo + batch]), y[lo:lo + batch])
        grad = loss.backward()
        if group.rank == slow:
            busy(delay)
        ddp.backward(grad)
        opt.step()
        axond.mark_step()  # the dashboard plots step times
        if group.rank == 0:
            print(f"step {i + 1}", flush=True)
    axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
