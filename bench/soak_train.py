"""The rank program of bench/soak.py: `DistributedTrainer` on a small MLP (a few MB) under `axond worker
--live-recovery`, for as long as the soak lasts.

argv: OUT_DIR. Every process writes `start-PID` (its host, first rank and generation), then one line per committed
step to `steps-PID.jsonl` (global step, world size, generation, the parameters' digest, time.monotonic() at the step's
end) and one line per re-formation it went through (`kind: "recovery"`, the trainer's `Recovery`) or state it took
from a live peer (`kind: "transfer"`). The soak ends the run by writing `OUT_DIR/stop` (a global step): every rank
leaves at the end of that step (it reads the file after each step; the soak writes a step far enough ahead that every
rank reads it before), so the job ends at the same step on every rank.

SOAK_HIDDEN (the MLP's width, default 512: 0.55 M float32 parameters, 2.1 MiB), SOAK_PARALLEL ("ddp" or "zero").
`build_trainer(group, callbacks)` is also the soak's fault-free reference (one process, the same virtual ranks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import axond
from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.train import Callback, DistributedTrainer

FEATURES, CLASSES, SAMPLES, BATCH = 32, 10, 4096, 8
"""4096 samples over 4 virtual ranks at batch 8: 128 steps an epoch."""
EPOCHS = 100_000
"""More than any soak runs: the stop file ends it."""
SEED = 11
GROUP_TIMEOUT_S = 30.0


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = ((x[:, 0] > x[:, 1]).astype(np.int64) * 5 + (x[:, 2] > 0.3) + (x[:, 3] > 0.6)) % CLASSES
    return x, y


def build_trainer(group: ProcessGroup | None, callbacks: list[Callback], hidden: int, parallel: str = "ddp",
                  virtual_ranks: int | None = None, copy_every: int = 1) -> DistributedTrainer:
    """The trainer every rank builds (the soak builds it too, in one process, for the fault-free hashes)."""
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(FEATURES, hidden, rng=rng), nn.Tanh(), nn.Dropout(0.1),
                          nn.Linear(hidden, hidden, rng=rng), nn.Tanh(), nn.Linear(hidden, hidden, rng=rng), nn.Tanh(),
                          nn.Linear(hidden, CLASSES, rng=rng))
    options: dict[str, Any] = {"parallel": parallel, "seed": SEED, "copy_every": copy_every}
    if virtual_ranks is not None:
        options["virtual_ranks"] = virtual_ranks
    return DistributedTrainer(model, lambda params: AdamW(params, lr=1e-3), nn.CrossEntropyLoss(), dataset(),
                              batch_size=BATCH, progress=False, clip_norm=1.0, callbacks=callbacks, group=group,
                              **options)


def params_hash(trainer: DistributedTrainer) -> str:
    """A digest of every parameter's bytes, in state-dict order."""
    digest = hashlib.sha256()
    for value in trainer.module.state_dict().values():
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:16]


class Log(Callback):
    """Each committed step, each re-formation and each state transfer, one JSON line each, as they happen."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.stop_file = out / "stop"
        self.log = open(out / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")  # closed at exit
        self.recoveries = self.transfers = 0
        self.stop_at: int | None = None

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        now = time.monotonic()
        virtual = trainer.virtual
        lines = []
        if virtual is not None:
            for r in virtual.recoveries[self.recoveries:]:
                lines.append({"kind": "recovery", **dataclasses.asdict(r)})
            for t in virtual.transfers[self.transfers:]:
                lines.append({"kind": "transfer", **dataclasses.asdict(t)})
            self.recoveries, self.transfers = len(virtual.recoveries), len(virtual.transfers)
        step = int(metrics["global_step"])
        lines.append({"kind": "step", "step": step, "world": trainer.world_size, "rank": trainer.rank,
                      "gen": int(os.environ["AXOND_GENERATION"]), "hash": params_hash(trainer), "mono": now})
        self.log.write("".join(json.dumps(line) + "\n" for line in lines))
        self.log.flush()
        if self.stop_at is None and self.stop_file.exists():
            text = self.stop_file.read_text().strip()
            self.stop_at = int(text) if text else None
        if self.stop_at is not None and step >= self.stop_at:
            self.log.close()
            (self.out / f"end-{os.getpid()}").write_text(str(step))
            os._exit(0)  # every rank leaves after the same step; nothing more is sent


def main() -> None:
    out = Path(sys.argv[1])
    (out / f"start-{os.getpid()}").write_text(json.dumps({
        "host": socket.gethostname(), "rank": int(os.environ["RANK"]), "gen": int(os.environ["AXOND_GENERATION"]),
        "mono": time.monotonic()}))
    axond.init_process_group("tcp", timeout=GROUP_TIMEOUT_S)
    trainer = build_trainer(None, [Log(out)], int(os.environ.get("SOAK_HIDDEN", "512")),
                            os.environ.get("SOAK_PARALLEL", "ddp"),
                            copy_every=int(os.environ.get("SOAK_COPY_EVERY", "1")))
    trainer.fit(EPOCHS)
    raise SystemExit(f"the soak ran out of its {EPOCHS} epochs before its stop file ended it")


if __name__ == "__main__":
    main()
