"""What the buddy copies of ZeRO-1 shards cost per step (not a test): steps/s of `DistributedTrainer(parallel="zero")`
on virtual ranks with the copies off (`copy_every=None`), after every step (`copy_every=1`) and every 10th.

    python bench/shard_copies.py --world 2 --hidden 1024 --steps 30 --rounds 2

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes), one BLAS thread each. The
model: an MLP of `--hidden` units (four weight layers), AdamW, batch 8 per virtual rank, `virtual_ranks=--world`.
Each configuration runs `--rounds` times, the configurations interleaved (A B C A B C) so that a busy machine's load
falls on all of them alike; a cell is the median over every rank and round of the rank's median step (the first 3
left out). CPU per step is the process's CPU time (all its threads, the communication thread's included) per step,
steadier than wall time on a shared machine; "copies on the training thread" is what keeping the gradients, packing,
posting and waiting for the copies took on the thread that trains (`BuddyCopies.busy_s`). "copy MB/step" is what
each rank sends to its buddy per copy: its block of shards, the parameters and AdamW's two moments (3 x parameters /
world, float32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from axond import nn
from axond.distributed import default_group
from axond.nn.optim import AdamW
from axond.testing import run_processes
from axond.train import Callback, DistributedTrainer

CONFIGS: tuple[tuple[str, int | None], ...] = (("no copies (copy_every=None)", None), ("every step (copy_every=1)", 1),
                                               ("every 10th step (copy_every=10)", 10))


WARMUP = 3


class _StepTimes(Callback):
    """Wall time of each step; CPU time (every thread of the process) and the copies' time on the training thread
    from the end of the warm-up steps on."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0
        self.cpu = 0.0
        self.busy = 0.0

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        if len(self.times) == WARMUP:
            self.cpu = time.process_time()
            copies = trainer.virtual.copies
            self.busy = copies.busy_s if copies is not None else 0.0

    def result(self, trainer: Any) -> tuple[float, float, float]:
        """(median wall step, CPU seconds per step, copies' seconds on the training thread per step)."""
        n = len(self.times) - WARMUP
        copies = trainer.virtual.copies
        busy = (copies.busy_s if copies is not None else 0.0) - self.busy
        return float(statistics.median(self.times[WARMUP:])), (time.process_time() - self.cpu) / n, busy / n


@dataclass(frozen=True)
class _Run:
    """Picklable per-rank entry point for run_processes (the children import this module)."""

    hidden: int
    steps: int
    copy_every: int | None

    def __call__(self) -> tuple[float, float, float]:
        group = default_group()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.steps * 8 * group.size, 64)).astype(np.float32)
        y = rng.integers(0, 10, len(x))
        layers: list[nn.Module] = [nn.Linear(64, self.hidden, rng=rng), nn.Tanh()]
        for _ in range(2):
            layers += [nn.Linear(self.hidden, self.hidden, rng=rng), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(self.hidden, 10, rng=rng))
        times = _StepTimes()
        trainer = DistributedTrainer(model, lambda p: AdamW(p, lr=1e-3), nn.CrossEntropyLoss(), (x, y),
                                     batch_size=8, group=group, progress=False, shuffle=False, callbacks=[times],
                                     parallel="zero", virtual_ranks=group.size, copy_every=self.copy_every)
        times.last = time.perf_counter()
        trainer.fit(1)
        return times.result(trainer)


def _params(hidden: int) -> int:
    return 64 * hidden + hidden + 2 * (hidden * hidden + hidden) + hidden * 10 + 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    params = _params(args.hidden)
    copy_mb = 3 * params * 4 / args.world / 2**20
    print(f"{args.world} ranks on loopback, ZeRO-1 on {args.world} virtual ranks, MLP of {params:,} float32 parameters "
          f"({params * 4 / 2**20:.1f} MiB), AdamW, batch 8 per virtual rank; {args.steps} steps x {args.rounds} "
          f"rounds; load average before: {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in CONFIGS}
    for _ in range(args.rounds):
        for name, every in CONFIGS:
            runs[name] += run_processes(_Run(args.hidden, args.steps, every), args.world, timeout=600)
    print(f"load average after: {os.getloadavg()[0]:.1f}")

    def median(name: str, i: int) -> float:
        return float(statistics.median(r[i] for r in runs[name]))

    wall, cpu = median(CONFIGS[0][0], 0), median(CONFIGS[0][0], 1)
    print("| buddy copies | median step (ms) | steps/s | vs no copies | CPU per step (ms) | vs no copies | "
          "copies on the training thread (ms/step) | copy MB/step per rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, every in CONFIGS:
        w, c, b = median(name, 0), median(name, 1), median(name, 2)
        copy = "0" if every is None else f"{copy_mb / every:.1f}"
        print(f"| {name} | {w * 1e3:.1f} | {1 / w:.2f} | {(w / wall - 1) * 100:+.1f} % | {c * 1e3:.1f} | "
              f"{(c / cpu - 1) * 100:+.1f} % | {b * 1e3:.2f} | {copy} |", flush=True)


if __name__ == "__main__":
    main()
