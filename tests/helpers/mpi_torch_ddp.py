"""A torch DDP rank over torch.distributed's "axond" backend on the axond "mpi" backend: `mpirun -n 2 python
mpi_torch_ddp.py OUT` with AXOND_TORCH_BACKEND=mpi. Trains `steps` of SGD on this rank's shard of `batch()`; rank 0
saves the parameters to OUT (tests/torch/test_torch_mpi.py compares them with one process on the whole batch)."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import axond.torch  # noqa: F401 -- registers the "axond" backend

STEPS = 5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)


def train(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def main() -> int:
    dist.init_process_group("axond")
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = batch()
    rows = x.shape[0] // size
    net = DDP(model())
    train(net, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
    if rank == 0:
        np.savez(sys.argv[1], **{k: v.detach().numpy() for k, v in net.module.state_dict().items()})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
