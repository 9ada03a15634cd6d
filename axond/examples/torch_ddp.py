"""torch DDP on axond: a small MLP regression on synthetic data, gradients averaged by axond's data plane.

Run it with `axond worker --coordinator HOST:PORT --nproc-per-node 2 -- python -m axond.examples.torch_ddp`.
The two lines that differ from a torchrun script: `import axond.torch` and the backend name "axond".
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import axond.torch  # noqa: F401 -- registers the "axond" backend


def build_model(seed: int) -> torch.nn.Module:
    """The same initial weights on every rank (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 1))


def batches(rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own samples of y = sum(sin(x)) (a learnable target)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=gen)
        out.append((x, torch.sin(x).sum(dim=1, keepdim=True)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective raises")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("axond", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DDP(build_model(args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"torch DDP on {size} rank(s), backend {dist.get_backend()}", flush=True)
    for step, (x, y) in enumerate(batches(rank, args.steps, args.batch), 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step}/{args.steps} loss {float(mean):.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
