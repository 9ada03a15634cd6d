"""The straggler job of `axond.testing.straggler_job` over torch DDP on the "axond" backend: 8 layers of 64 in
16 KiB buckets (6 all_reduces per step); rank SLOW_RANK busy-waits SLOW_S seconds before each backward.

    axond worker --standalone --nproc-per-node 4 -- python -m axond.testing.straggler_torch_job STEPS
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import axond.torch  # noqa: F401 -- registers the "axond" backend
from axond.testing.straggler_job import busy, settings


def main(argv: list[str]) -> int:
    steps, slow, delay = settings(argv)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
