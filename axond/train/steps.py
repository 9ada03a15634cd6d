"""The trainer's loop without virtual ranks: epochs of optimizer steps over each rank's data shard, and evaluation.

Each optimizer step runs `grad_accum_steps` micro-batches (the wrapper's gradient sync held back until the last),
clips, and steps the optimizer; after each step the replica check may roll every rank back, and every
`checkpoint_every` steps a checkpoint is saved (`axond.train.checkpointing`). The loop on virtual ranks, which
survives a membership change, is `axond.train.live`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from axond.distributed.diagnostics.steps import mark_step
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.parallel import DistributedSampler, Pipeline
from axond.train.progress import Progress

if TYPE_CHECKING:
    from axond.train.trainer import DistributedTrainer


class Steps:
    """One trainer's epochs and steps, its running loss sums in `trainer._totals`."""

    def __init__(self, trainer: DistributedTrainer) -> None:
        self.trainer = trainer

    def steps_per_epoch(self) -> tuple[int, int]:
        """(micro-batches, optimizer steps) per epoch on this rank."""
        t = self.trainer
        micro = math.ceil(t.sampler.num_samples / t.batch_size)
        return micro, math.ceil(micro / t.grad_accum_steps)

    def train_step(self, indices: np.ndarray, step: int, micro: int) -> int:
        """One optimizer step over this rank's micro-batches of `step`; returns the samples it used."""
        t = self.trainer
        first = step * t.grad_accum_steps
        count = min(t.grad_accum_steps, micro - first)
        t.optimizer.zero_grad()
        t.model.zero_grad()
        used = 0
        for m in range(count):
            rows = indices[(first + m) * t.batch_size : (first + m + 1) * t.batch_size]
            x, y = t.dataset.batch(rows)
            if isinstance(t.model, Pipeline):
                t._totals += (t.model.step(x, y) * len(rows), len(rows))
                used += len(rows)
                continue
            quiet = m < count - 1 and hasattr(t.model, "no_sync")
            with t.model.no_sync() if quiet else contextlib.nullcontext():
                loss = float(t.loss_fn(t.model(x), y))
                grad = t.loss_fn.backward()
                t.model.backward(grad / count if count > 1 else grad)
            t._totals += (loss * len(rows), len(rows))
            used += len(rows)
        if count > 1 and isinstance(t.model, Pipeline):
            for p in t.model.parameters():
                if p.grad is not None:
                    p.grad *= 1.0 / count
        if t.clip_norm is not None:
            t._clip(t.clip_norm)
        t.optimizer.step()
        return used

    def run_epochs(self, epochs: int, progress: Progress) -> bool:
        """Train from `position` to the end of `epochs`; False when a replica check rolled back first."""
        t = self.trainer
        pos = t.position
        micro, steps = self.steps_per_epoch()
        while pos.epoch < epochs:
            t.sampler.set_epoch(pos.epoch)
            indices = t.sampler.indices()
            if pos.step == 0:
                t._totals[:] = 0.0
            progress.start(pos.epoch + 1, steps, pos.step)
            start, seen = time.perf_counter(), 0
            while pos.step < steps:
                seen += self.train_step(indices, pos.step, micro)
                pos.step += 1
                pos.global_step += 1
                mark_step()
                rate = seen * t.data_replicas / max(time.perf_counter() - start, 1e-9)
                loss = float(t._totals[0] / max(t._totals[1], 1.0))
                progress.update(pos.step, loss, rate)
                t._call("on_step_end", {"epoch": pos.epoch + 1, "step": pos.step,
                                        "global_step": pos.global_step, "loss": loss})
                if not t.checkpoints.replicas_agree():
                    return False
                if t.checkpoint_every and pos.global_step % t.checkpoint_every == 0:
                    t.save_checkpoint()
            progress.close()
            self.end_epoch(epochs, seen * t.data_replicas / max(time.perf_counter() - start, 1e-9))
        return True

    def end_epoch(self, epochs: int, rate: float) -> None:
        """The epoch's metrics (mean loss over every rank, eval loss, callbacks' additions) into the history."""
        t = self.trainer
        pos = t.position
        totals = t._totals.copy()
        t.group.all_reduce(totals, op=ReduceOp.SUM)
        metrics: dict[str, float] = {"epoch": pos.epoch + 1, "loss": float(totals[0] / max(totals[1], 1.0))}
        if t.eval_dataset is not None:
            metrics["eval_loss"] = t.evaluate()
        t._call("on_epoch_end", metrics)
        metrics["samples_per_s"] = rate
        pos.history.append(metrics)
        if t.rank == 0 and t.progress_enabled:
            extra = "".join(f" {k} {v:.4f}" for k, v in metrics.items() if k not in ("epoch", "loss", "samples_per_s"))
            print(f"epoch {pos.epoch + 1}/{epochs} loss {metrics['loss']:.4f}{extra} samples/s {rate:.0f}", flush=True)
        pos.epoch += 1
        pos.step = 0
        t._totals[:] = 0.0

    def evaluate(self) -> float:
        """Mean loss over `eval_dataset` (every rank evaluates its shard; collective)."""
        t = self.trainer
        if t.eval_dataset is None:
            raise ValueError("evaluate needs eval_dataset=")
        replica = t.rank if t.data_replicas > 1 else 0
        sampler = DistributedSampler(len(t.eval_dataset), t.data_replicas, replica, shuffle=False)
        indices = sampler.indices()
        sums = np.zeros(2, np.float64)
        t.model.eval()
        try:
            for lo in range(0, len(indices), t.batch_size):
                rows = indices[lo : lo + t.batch_size]
                x, y = t.eval_dataset.batch(rows)
                out = t.model.forward(x) if isinstance(t.model, Pipeline) else t.model(x)
                if out is not None:  # a pipeline's output is on its last stage's rank only
                    sums += (float(t.loss_fn(out, y)) * len(rows), len(rows))
        finally:
            t.model.train()
        if t.parallel != "tp":  # tensor-parallel ranks computed the same sums
            t.group.all_reduce(sums, op=ReduceOp.SUM)
        return float(sums[0] / max(sums[1], 1.0))
