"""Run by test_trainer under `axond worker --max-restarts 1`: trains, dies at a step on the first attempt, resumes."""

from __future__ import annotations

import sys

import axond
from trainer_cases import DieAt, make_trainer


def main() -> None:
    checkpoint_dir, marker_dir, die_at, parallel, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    group = axond.init_process_group("tcp")
    try:
        trainer = make_trainer(group, checkpoint_dir, parallel=parallel, callbacks=[DieAt(die_at, marker_dir, hard=True)])
        history = trainer.fit(epochs)
        if group.rank == 0:
            print(f"resumed from {trainer.resumed_from}; losses {[round(h['loss'], 6) for h in history]}", flush=True)
    finally:
        axond.destroy_process_group()


if __name__ == "__main__":
    main()
