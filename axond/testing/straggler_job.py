"""A small native DDP job whose rank SLOW_RANK busy-waits SLOW_S seconds in each step's backward (a compute
straggler), for the straggler test and `bench/stragglers.py`:

    axond worker --standalone --nproc-per-node 4 -- python -m axond.testing.straggler_job STEPS [--torch]

Rank 0 prints `step N` after each step. The native model has 8 hidden layers of 64 and 4 KiB buckets: 18
all_reduces per step (set AXOND_STRAGGLER_WINDOW_OPS to a multiple of 18, so that every window holds whole steps).
`--torch`: torch DDP over the "axond" backend, 8 layers of 64 in 16 KiB buckets (6 all_reduces per step).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

OPS_PER_STEP = 18
"""The all_reduces of one step (one per bucket)."""


def busy(seconds: float) -> None:
    """Burn `seconds` of CPU (compute, not a sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def torch_main(steps: int, slow: int, delay: float) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import axond.torch  # noqa: F401 -- registers the "axond" backend

    dist.init_process_group("axond")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, 64)]
    for _ in range(8):
        layers += [torch.nn.ReLU(), torch.nn.Linear(64, 64)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.016)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 32), torch.randn(32, 64)
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == slow:
            busy(delay)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {i + 1}", flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    steps = int(argv[0]) if argv else 20
    slow, delay = int(os.environ.get("SLOW_RANK", "-1")), float(os.environ.get("SLOW_S", "0.2"))
    if "--torch" in argv:
        return torch_main(steps, slow, delay)
    import axond
    from axond.distributed import api
    from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
    from axond.nn import CrossEntropyLoss
    from axond.nn.optim import SGD
    from axond.parallel import DDP

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
        if group.rank == 0:
            print(f"step {i + 1}", flush=True)
    axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
