"""The trainer run the resume tests repeat: a small MLP on a seeded data set, and a callback that dies at a step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.train import Callback, DistributedTrainer

X = np.random.default_rng(5).standard_normal((72, 6)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int64) + (X[:, 2] > 0.5)


def make_trainer(group: ProcessGroup, checkpoint_dir: str | Path | None, **options: Any) -> DistributedTrainer:
    """72 samples over 2 ranks at batch 4: 9 micro-batches per rank per epoch; Dropout makes the random state matter."""
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(6, 10, rng=rng), nn.Tanh(), nn.Dropout(0.2, seed=group.rank), nn.Linear(10, 3, rng=rng))
    defaults: dict[str, Any] = dict(batch_size=4, parallel="ddp", checkpoint_every=3, group=group, clip_norm=1.0,
                                    progress=False)
    defaults.update(options)
    return DistributedTrainer(model, lambda params: AdamW(params, lr=0.02), nn.CrossEntropyLoss(), (X, Y),
                              checkpoint_dir=checkpoint_dir, **defaults)


def final_params(trainer: DistributedTrainer) -> dict[str, np.ndarray]:
    """The full parameters (collective under FSDP)."""
    model = trainer.model
    if hasattr(model, "full_state_dict"):
        return {k: v.copy() for k, v in model.full_state_dict().items()}
    return {k: v.copy() for k, v in trainer.module.state_dict().items()}


class DieAt(Callback):
    """At global step `step`, the first time only (a marker file per rank): `os._exit` or raise."""

    def __init__(self, step: int, marker_dir: str | Path, hard: bool) -> None:
        self.step, self.marker_dir, self.hard = step, Path(marker_dir), hard

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        if metrics["global_step"] != self.step:
            return
        marker = self.marker_dir / f"died.{trainer.rank}"
        if marker.exists():
            return
        marker.write_text("1")
        if self.hard:
            os._exit(17)
        raise KeyboardInterrupt(f"killed at step {self.step}")
