"""Train a classifier with DDP, ZeRO-1 or FSDP on a synthetic, learnable data set; what `compose.yaml` runs.

    axond worker --coordinator HOST:PORT --nnodes 1 --nproc-per-node 2 -- python -m axond.examples.train_mlp
    ... -- python -m axond.examples.train_mlp --parallel fsdp --sharding shard_grad_op

The data set is drawn from `--seed`: Gaussian inputs labelled by a fixed random "teacher"
network, so the student can learn it and every rank generates the same data without any files.
Each rank trains on its `DistributedSampler` shard; rank 0 logs the loss (averaged over ranks),
shows a progress bar when stderr is a terminal, and saves a checkpoint (.npz) at the end.
Started without RANK/WORLD_SIZE it runs as a single process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import axond
from axond import nn
from axond.distributed import ProcessGroup, default_group
from axond.nn.optim import AdamW, Optimizer
from axond.nn.utils import clip_grad_norm_, save_checkpoint
from axond.parallel import DDP, FSDP, DistributedSampler, ShardingStrategy, ZeroRedundancyOptimizer


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


def _progress(epoch: int, epochs: int, step: int, steps: int, loss: float) -> None:
    width = 30
    filled = width * step // max(steps, 1)
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\repoch {epoch}/{epochs} [{bar}] {step}/{steps} loss {loss:.4f}")
    sys.stderr.flush()


class Trainer(NamedTuple):
    """The wrapped model with what a step needs: its optimizer, gradient clipping and a full state dict."""

    model: nn.Module
    opt: Optimizer
    clip: Callable[[float], float]
    state: Callable[[], dict[str, Any]]
    """Collective for fsdp: every rank calls it (rank 0 gets the full state)."""


def wrap(cfg: TrainConfig, model: nn.Module, group: ProcessGroup) -> Trainer:
    """Wrap `model` for `cfg.parallel` over `group`."""
    decay = 1e-4
    if cfg.parallel == "fsdp":
        fsdp = FSDP(model, group, sharding_strategy=ShardingStrategy[cfg.sharding.upper()])
        return Trainer(fsdp, AdamW(list(fsdp.parameters()), lr=cfg.lr, weight_decay=decay), fsdp.clip_grad_norm_,
                       lambda: dict(fsdp.full_state_dict(rank0_only=True)))
    ddp = DDP(model, group, bucket_cap_mb=cfg.bucket_cap_mb)
    params = list(model.parameters())
    opt: Optimizer = (ZeroRedundancyOptimizer(params, AdamW, group, lr=cfg.lr, weight_decay=decay)
                      if cfg.parallel == "zero" else AdamW(params, lr=cfg.lr, weight_decay=decay))
    return Trainer(ddp, opt, lambda max_norm: clip_grad_norm_(params, max_norm), lambda: dict(model.state_dict()))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    model.eval()
    pred = model(x).argmax(axis=1)
    model.train()
    return float((pred == y).mean())


def train(cfg: TrainConfig, group: Any = None) -> dict[str, Any]:
    """Train over `group` (default: axond's default group); returns per-epoch losses and the test accuracy."""
    x_train, y_train, x_test, y_test = make_dataset(cfg)
    comm = group if group is not None else default_group()
    rank, world = comm.rank, comm.size
    trainer = wrap(cfg, build_model(cfg), comm)
    model, opt = trainer.model, trainer.opt
    loss_fn = nn.CrossEntropyLoss()
    sampler = (DistributedSampler(len(x_train), shuffle=True, seed=cfg.seed) if group is None
               else DistributedSampler(len(x_train), world, rank, shuffle=True, seed=cfg.seed))
    show_bar = rank == 0 and sys.stderr.isatty()
    losses: list[float] = []
    totals = np.zeros(2, dtype=np.float64)
    for epoch in range(1, cfg.epochs + 1):
        sampler.set_epoch(epoch)
        indices = sampler.indices()
        steps = (len(indices) + cfg.batch_size - 1) // cfg.batch_size
        totals[:] = 0.0
        start = time.perf_counter()
        for step in range(steps):
            batch = indices[step * cfg.batch_size : (step + 1) * cfg.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            model.backward(loss_fn.backward())
            trainer.clip(5.0)
            opt.step()
            totals += (loss * len(batch), len(batch))
            if show_bar:
                _progress(epoch, cfg.epochs, step + 1, steps, totals[0] / totals[1])
        comm.all_reduce(totals, op=axond.ReduceOp.SUM)
        losses.append(float(totals[0] / totals[1]))
        acc = accuracy(model, x_test, y_test)  # on every rank: FSDP gathers parameters collectively
        if rank == 0:
            if show_bar:
                sys.stderr.write("\n")
            rate = totals[1] / (time.perf_counter() - start)
            print(f"epoch {epoch}/{cfg.epochs} loss {losses[-1]:.4f} test_acc {acc:.3f} samples/s {rate:.0f}", flush=True)
    test_acc = accuracy(model, x_test, y_test)
    state = trainer.state() if cfg.checkpoint else {}
    if rank == 0 and cfg.checkpoint:
        state["epochs"] = np.array(cfg.epochs)
        save_checkpoint(cfg.checkpoint, state)
        print(f"saved checkpoint {cfg.checkpoint}", flush=True)
    return {"losses": losses, "test_acc": test_acc, "world_size": world}


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
    p.add_argument("--backend", default=d.backend, choices=["auto", "tcp", "nccl"])
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    p.add_argument("--parallel", default=d.parallel, choices=["ddp", "zero", "fsdp"],
                   help="ddp, zero (DDP + ZeroRedundancyOptimizer) or fsdp")
    p.add_argument("--sharding", default=d.sharding, choices=["full_shard", "shard_grad_op", "no_shard"],
                   help="FSDP sharding strategy (with --parallel fsdp)")
    a = p.parse_args(argv)
    for name in ("epochs", "batch_size", "samples", "hidden", "depth"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    return TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, samples=a.samples, hidden=a.hidden,
                       depth=a.depth, seed=a.seed, checkpoint=a.checkpoint, backend=a.backend, bucket_cap_mb=a.bucket_cap_mb,
                       parallel=a.parallel, sharding=a.sharding)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if "WORLD_SIZE" in os.environ:
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
