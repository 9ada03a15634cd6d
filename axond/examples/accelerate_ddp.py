"""Hugging Face Accelerate on "axond": initialize the "axond" group first, then `Accelerator(cpu=True)` takes
it as it is, and `accelerator.prepare` wraps the model in torch DDP over it.

    torchrun --nproc-per-node 2 -m axond.examples.accelerate_ddp
    axond worker --coordinator HOST:PORT --nproc-per-node 2 -- python -m axond.examples.accelerate_ddp

Accelerate has no way to name a third-party backend (`Accelerator(backend=...)`/`PartialState(backend=...)`
refuse any name it does not know), but it never re-initializes a group that exists. Rank 0 prints the loss
and a digest of the trained parameters (`--backend gloo` gives the same digest). Needs `pip install accelerate`.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

import axond.torch  # noqa: F401 -- registers the "axond" backend
from axond.examples.torch_regression import dataset, digest


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="axond", help="the group initialized before Accelerator (gloo for comparison)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective raises")
    p.add_argument("--save", help="rank 0 writes the trained state dict here (torch.save)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    accelerator = Accelerator(cpu=True)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    size = accelerator.num_processes
    loader = DataLoader(dataset(args.steps * args.batch * size), batch_size=args.batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
    mean = accelerator.reduce(loss.detach(), reduction="mean")
    if accelerator.is_main_process:
        trained = accelerator.unwrap_model(model)
        print(f"accelerate DDP on {size} rank(s), group backend {dist.get_backend()}: loss {float(mean):.6f}, "
              f"parameters {digest(trained)}", flush=True)
        if args.save:
            torch.save(trained.state_dict(), args.save)
    accelerator.end_training()  # destroys the group
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
