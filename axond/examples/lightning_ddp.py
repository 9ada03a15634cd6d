"""Lightning DDP on "axond": a small regression trained by `lightning.Trainer` with
`DDPStrategy(process_group_backend="axond")`; nothing else differs from a gloo script.

    python -m axond.examples.lightning_ddp --devices 2                    # Lightning's own launcher
    python -m axond.examples.lightning_ddp --devices 2 --launcher fork    # Lightning's ddp_fork launcher
    torchrun --nproc-per-node 2 -m axond.examples.lightning_ddp --devices 2

Rank 0 prints the loss and a digest of the trained parameters (`--backend gloo` gives the same digest).
Needs `pip install lightning`.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import axond.torch  # noqa: F401 -- registers the "axond" backend
from axond.examples.torch_regression import dataset, digest


class Regression(L.LightningModule):
    """An MLP fitting y = sum(sin(x)), with plain SGD (deterministic, so the backends can be compared bit by bit)."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="ranks on this machine (torchrun's --nproc-per-node)")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--backend", default="axond", help="process_group_backend (gloo gives the same digest)")
    p.add_argument("--launcher", choices=["popen", "fork", "spawn"], default="popen",
                   help="Lightning's launcher: popen (re-runs this command per rank; torchrun's ranks are used "
                        "as they are), fork (ddp_fork) or spawn (ddp_spawn)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective raises")
    p.add_argument("--save", help="rank 0 writes the trained state dict here (torch.save)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strategy = DDPStrategy(process_group_backend=args.backend, timeout=timedelta(seconds=args.timeout),
                           start_method=args.launcher)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=True)
    model = Regression(args.lr)
    data = DataLoader(dataset(args.steps * args.batch * args.devices * args.num_nodes), batch_size=args.batch)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        loss = float(trainer.callback_metrics["loss"])
        print(f"lightning DDP on {trainer.world_size} rank(s), backend {args.backend}: loss {loss:.6f}, "
              f"parameters {digest(model)}", flush=True)
        if args.save:
            torch.save(model.net.state_dict(), args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
