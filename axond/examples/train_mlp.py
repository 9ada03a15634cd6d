"""Train a classifier with DDP, ZeRO-1 or FSDP on a synthetic, learnable data set; what `compose.yaml` runs.

    axond worker --coordinator HOST:PORT --nnodes 1 --nproc-per-node 2 -- python -m axond.examples.train_mlp
    ... -- python -m axond.examples.train_mlp --parallel fsdp --sharding shard_grad_op
    ... --max-restarts 3 -- python -m axond.examples.train_mlp --checkpoint-dir ckpts --checkpoint-every 50

The data set is drawn from `--seed`: Gaussian inputs labelled by a fixed random "teacher"
network, so the student can learn it and every rank generates the same data without any files.
Training is `axond.train.DistributedTrainer`: each rank trains on its `DistributedSampler` shard,
rank 0 logs the loss (averaged over ranks) and shows progress; with `--checkpoint-dir` it saves
sharded checkpoints and a restarted run resumes from the newest. Rank 0 writes the final full
weights (.npz) to `--checkpoint`. Started without RANK/WORLD_SIZE it runs as a single process.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

import axond
from axond import nn
from axond.config import RuntimeEnv
from axond.distributed import default_group
from axond.nn.optim import AdamW
from axond.nn.utils import save_checkpoint
from axond.parallel import FSDP
from axond.train import Callback, DistributedTrainer


@dataclass(frozen=True)
class TrainConfig:
    """Options of one training run."""

    epochs: int = 5
    """Passes over the training set."""
    batch_size: int = 64
    """Samples per rank per step."""
    lr: float = 2e-3
    """AdamW learning rate."""
    samples: int = 8192
    """Training-set size (plus a quarter as much held out for accuracy)."""
    features: int = 32
    """Input features."""
    classes: int = 8
    """Number of classes."""
    hidden: int = 128
    """Hidden width of the student MLP."""
    depth: int = 1
    """Number of hidden (hidden x hidden) layers after the first."""
    seed: int = 0
    """Seed of the data, the initialisation and the shuffles."""
    checkpoint: str = "checkpoints/train_mlp.npz"
    """Where rank 0 saves the final weights ("" to skip)."""
    backend: str = "auto"
    """Collective backend: tcp, nccl or auto."""
    bucket_cap_mb: float = 25.0
    """DDP bucket size."""
    parallel: str = "ddp"
    """How the ranks share the work: ddp, zero (DDP + ZeroRedundancyOptimizer) or fsdp."""
    sharding: str = "full_shard"
    """FSDP sharding strategy (full_shard, shard_grad_op, no_shard) with --parallel fsdp."""
    checkpoint_dir: str = ""
    """Directory of sharded training checkpoints to save into and resume from ("" for none)."""
    checkpoint_every: int = 0
    """Optimizer steps between checkpoints (0: only at the end, when --checkpoint-dir is given)."""


def make_dataset(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test), all determined by `cfg.seed`."""
    rng = np.random.default_rng((cfg.seed, 17))
    n_test = max(cfg.samples // 4, 1)
    x = rng.standard_normal((cfg.samples + n_test, cfg.features)).astype(np.float32)
    w1 = rng.standard_normal((cfg.features, 64)) / np.sqrt(cfg.features)
    w2 = rng.standard_normal((64, cfg.classes)) / 8.0
    y = (np.tanh(x @ w1) @ w2).argmax(axis=1).astype(np.int64)
    return x[: cfg.samples], y[: cfg.samples], x[cfg.samples :], y[cfg.samples :]


def build_model(cfg: TrainConfig, dtype: Any = np.float32) -> nn.Sequential:
    """The student: a GELU MLP (LayerNorm after the first layer), initialised from `cfg.seed`."""
    rng = np.random.default_rng((cfg.seed, 23))
    layers: list[nn.Module] = [nn.Linear(cfg.features, cfg.hidden, dtype=dtype, rng=rng), nn.GELU(), nn.LayerNorm(cfg.hidden, dtype=dtype)]
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.hidden, cfg.hidden, dtype=dtype, rng=rng), nn.GELU()]
    layers.append(nn.Linear(cfg.hidden, cfg.classes, dtype=dtype, rng=rng))
    return nn.Sequential(*layers)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    pred = model(x).argmax(axis=1)
    model.train()
    return float((pred == y).mean())


class TestAccuracy(Callback):
    """Adds the held-out accuracy to each epoch's metrics (on every rank: FSDP gathers parameters collectively)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def on_epoch_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        metrics["test_acc"] = accuracy(trainer.model, self.x, self.y)


def make_trainer(cfg: TrainConfig, group: Any = None) -> DistributedTrainer:
    """The trainer for `cfg` over `group` (default: axond's default group)."""
    x_train, y_train, x_test, y_test = make_dataset(cfg)
    return DistributedTrainer(
        build_model(cfg), lambda params: AdamW(params, lr=cfg.lr, weight_decay=1e-4), nn.CrossEntropyLoss(),
        (x_train, y_train), batch_size=cfg.batch_size, parallel=cfg.parallel,
        checkpoint_dir=cfg.checkpoint_dir or None, checkpoint_every=cfg.checkpoint_every or None,
        clip_norm=5.0, group=group if group is not None else default_group(), sharding=cfg.sharding, seed=cfg.seed,
        callbacks=[TestAccuracy(x_test, y_test)], wrapper_options={"bucket_cap_mb": cfg.bucket_cap_mb}
        if cfg.parallel != "fsdp" else None,
    )


def train(cfg: TrainConfig, group: Any = None) -> dict[str, Any]:
    """Train over `group` (default: axond's default group); returns per-epoch losses and the test accuracy."""
    trainer = make_trainer(cfg, group)
    history = trainer.fit(cfg.epochs)
    _, _, x_test, y_test = make_dataset(cfg)
    test_acc = accuracy(trainer.model, x_test, y_test)
    if cfg.checkpoint:
        model = trainer.model
        state = dict(model.full_state_dict(rank0_only=True)) if isinstance(model, FSDP) else dict(trainer.module.state_dict())
        if trainer.rank == 0:
            state["epochs"] = np.array(cfg.epochs)
            save_checkpoint(cfg.checkpoint, state)
            print(f"saved checkpoint {cfg.checkpoint}", flush=True)
    return {"losses": [h["loss"] for h in history], "test_acc": test_acc, "world_size": trainer.world_size,
            "resumed_from": trainer.resumed_from}


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m axond.examples.train_mlp", description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--depth", type=int, default=d.depth, help="hidden x hidden layers")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint", default=os.environ.get("AXOND_CHECKPOINT", d.checkpoint), help='"" to skip')
    p.add_argument("--checkpoint-dir", default=d.checkpoint_dir,
                   help="sharded training checkpoints: saved there, and a restarted run resumes from the newest")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="optimizer steps between checkpoints (0: only at the end)")
    p.add_argument("--backend", default=d.backend, choices=["auto", "tcp", "nccl", "mpi"])
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--parallel", default=d.parallel, choices=["ddp", "zero", "fsdp"],
                   help="ddp, zero (DDP + ZeroRedundancyOptimizer) or fsdp")
    p.add_argument("--sharding", default=d.sharding, choices=["full_shard", "shard_grad_op", "no_shard"],
                   help="FSDP sharding strategy (with --parallel fsdp)")
    a = p.parse_args(argv)
    for name in ("epochs", "batch_size", "samples", "hidden", "depth"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {a.checkpoint_every}")
    if a.checkpoint_every and not a.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    return TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, samples=a.samples, hidden=a.hidden,
                       depth=a.depth, seed=a.seed, checkpoint=a.checkpoint, backend=a.backend, bucket_cap_mb=a.bucket_cap_mb,
                       parallel=a.parallel, sharding=a.sharding, checkpoint_dir=a.checkpoint_dir,
                       checkpoint_every=a.checkpoint_every)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if RuntimeEnv.from_env().world_size is not None:  # a launcher's: axond worker, torchrun, mpirun, srun
        group = axond.init_process_group(cfg.backend)
    else:
        group = axond.init_process_group("tcp", rank=0, world_size=1, store=axond.InMemoryStore(), host="127.0.0.1")
    try:
        if group.rank == 0:
            print(f"training on {group.size} rank(s), backend {group.backend_name}", flush=True)
        train(cfg)
    finally:
        axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
