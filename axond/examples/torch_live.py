"""torch DDP over "axond" that trains on when a node fails: `axond.torch.live.Manager` under `--live-recovery`.

Run it on three workers (three machines, or three times on one) and kill one of them mid-training; the other two
keep their processes, re-form and finish with the loss of a run without the failure:

    axond worker --coordinator HOST:PORT --nnodes 2:3 --job demo --live-recovery -- python -m axond.examples.torch_live

The global batch is fixed on `--virtual-ranks` virtual data-parallel ranks (default: the most the job may have);
each physical rank carries a block of them, so a lost rank moves work, not the math.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import axond.torch  # noqa: F401 -- registers the "axond" backend
from axond.torch.live import Manager


def batch(step: int, v: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Virtual rank v's samples of step `step` (y = sum(sin(x))): defined by (step, v), never by a physical rank."""
    gen = torch.Generator().manual_seed(step * 1_000 + v)
    x = torch.randn(size, 16, generator=gen)
    return x, torch.sin(x).sum(dim=1, keepdim=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="samples per virtual rank per step")
    p.add_argument("--virtual-ranks", type=int, default=None, help="default: --nnodes MAX x --nproc-per-node")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("axond")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    manager = Manager(model, optimizer, virtual_ranks=args.virtual_ranks)
    while manager.current_step() < args.steps:
        with manager.step() as step:  # a membership change in here is caught
            for v in step.virtual_ranks():
                x, y = batch(manager.current_step(), v, args.batch)
                step.backward(torch.nn.functional.mse_loss(manager.model(x), y))
        if manager.should_commit():  # the same answer on every rank; False: re-formed, the step runs again
            optimizer.step()
            if dist.get_rank() == 0 and manager.current_step() % 50 == 0:
                print(f"step {manager.current_step()}: loss {manager.loss:.5f} on {dist.get_world_size()} rank(s)",
                      flush=True)
    for r in manager.recoveries:
        print(f"re-formed at step {r.step}: world {r.world_before} -> {r.world_after} in "
              f"{r.reformed_at - r.error_at:.2f} s ({r.reason})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
