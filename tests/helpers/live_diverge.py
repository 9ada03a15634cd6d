"""Run by tests/worker/test_worker_live_diverge.py under `axond worker --live-recovery`: the trainer of live_train.py
with `digest_every`, where the process that starts as rank 2 flips one bit of its parameters after step FLIP_STEP.

argv: OUT_DIR FLIP_STEP EVERY. Every process records its start (`start-RANK-PID`), the parameters' hash after every
step (`steps-PID.jsonl`), and its end: `end-PID.json` (recoveries, restored states) and `params-PID.npz`, or
`diverged-PID.txt` with the `ReplicaDivergence` it raised (then it exits 1, as the error makes it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

import axond
from axond.errors import ReplicaDivergence
from axond.train import Callback, DistributedTrainer
from live_train import GROUP_TIMEOUT_S, build_trainer, params_hash


class FlipAndRecord(Callback):
    def __init__(self, out: Path, flip_step: int) -> None:
        self.flip_step = flip_step if os.environ["RANK"] == "2" else -1
        self.log = open(out / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")  # closed at exit

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        step = int(metrics["global_step"])
        if step == self.flip_step:
            first = next(iter(trainer.module.parameters())).data
            first.reshape(-1).view(np.uint32)[0] ^= np.uint32(1 << 22)  # one mantissa bit: a silent fault
            self.flip_step = -1
        self.log.write(json.dumps({"step": step, "world": trainer.world_size, "hash": params_hash(trainer)}) + "\n")
        self.log.flush()


def main() -> None:
    out, flip_step, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    (out / f"start-{os.environ['RANK']}-{os.getpid()}").write_text("")
    axond.init_process_group("tcp", timeout=GROUP_TIMEOUT_S)
    trainer = build_trainer(None, [FlipAndRecord(out, flip_step)], digest_every=every)
    try:
        trainer.fit(3)
    except ReplicaDivergence as e:
        (out / f"diverged-{os.getpid()}.txt").write_text(str(e))
        raise
    np.savez(out / f"params-{os.getpid()}.npz", **trainer.module.state_dict())
    assert trainer.virtual is not None and trainer.virtual.agreed is not None
    (out / f"end-{os.getpid()}.json").write_text(json.dumps({
        "rank": trainer.rank, "world": trainer.world_size,
        "recoveries": [dataclasses.asdict(r) for r in trainer.virtual.recoveries],
        "restored": trainer.virtual.agreed.restored}))
    axond.destroy_process_group()


if __name__ == "__main__":
    main()
