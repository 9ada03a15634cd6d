"""What the in-memory copies of ZeRO-1 shards cost per step (not a test): steps/s and CPU time of
`DistributedTrainer(parallel="zero")` on virtual ranks with no copies, buddy copies after every step (`copy_every=1`)
and every 10th, copies into the worker daemon's memory after every step, and both.

    python bench/shard_copies.py --world 2 --hidden 1152 --steps 40 --rounds 3

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes), one BLAS thread each. The
model: an MLP of `--hidden` units (four weight layers), AdamW, `--batch` (8) samples per virtual rank and step,
`virtual_ranks=--world`.
Each configuration runs `--rounds` times, the configurations interleaved (A B C A B C) so that a busy machine's load
falls on all of them alike; a cell is the median over every rank and round of the rank's median step (the first 3
left out). CPU per step is the process's CPU time (all its threads, the communication thread's included) per step,
steadier than wall time on a shared machine; "copies on the training thread" is what keeping the gradients, packing,
posting and waiting for the copies took on the thread that trains (`BuddyCopies.busy_s`). "copy MB/step" is what
each rank sends to its buddy per copy: its block of shards, the parameters and AdamW's two moments (3 x parameters /
world, float32). A daemon copy writes the same bytes into a memfd the rank process creates itself, as `axond worker`
would for it (`AXOND_SHARD_MEMORY_FD`), on a background thread. The last line measures this machine's memcpy: the
bandwidth of `np.copyto` of one rank's block into shared memory, and what one copy takes.
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

CONFIGS: tuple[tuple[str, int | None, bool], ...] = (
    ("none", None, False),
    ("buddy every step (copy_every=1)", 1, False),
    ("buddy every 10th step (copy_every=10)", 10, False),
    ("daemon every step", None, True),
    ("buddy + daemon every step", 1, True),
)
"""(name, copy_every, copies into daemon memory)."""


WARMUP = 3


class _StepTimes(Callback):
    """Wall time of each step; CPU time (every thread of the process) and the copies' time on the training thread
    from the end of the warm-up steps on."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0
        self.cpu = 0.0
        self.busy = 0.0
        self.copy_cpu = 0.0

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        if len(self.times) == WARMUP:
            self.cpu = time.process_time()
            self.busy = _busy(trainer)
            self.copy_cpu = _copy_cpu(trainer)

    def result(self, trainer: Any) -> tuple[float, float, float, float]:
        """(median wall step, CPU seconds per step, copies' seconds on the training thread per step, CPU seconds of the
        daemon copies' memcpy per step)."""
        n = len(self.times) - WARMUP
        busy = _busy(trainer) - self.busy
        copy_cpu = _copy_cpu(trainer) - self.copy_cpu
        return (float(statistics.median(self.times[WARMUP:])), (time.process_time() - self.cpu) / n, busy / n,
                copy_cpu / n)


def _copy_cpu(trainer: Any) -> float:
    daemon = trainer.virtual.daemon
    return daemon.copy_cpu_s if daemon is not None else 0.0


def _busy(trainer: Any) -> float:
    copies, daemon = trainer.virtual.copies, trainer.virtual.daemon
    return (copies.busy_s if copies is not None else 0.0) + (daemon.busy_s if daemon is not None else 0.0)


@dataclass(frozen=True)
class _Run:
    """Picklable per-rank entry point for run_processes (the children import this module)."""

    hidden: int
    steps: int
    copy_every: int | None
    daemon: bool
    batch: int

    def __call__(self) -> tuple[float, float, float, float]:
        group = default_group()
        os.environ.pop("AXOND_SHARD_MEMORY_FD", None)
        if self.daemon:  # what `axond worker` hands its rank: a memfd it inherits
            os.environ["AXOND_SHARD_MEMORY_FD"] = str(os.memfd_create("axond-bench-shards"))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.steps * self.batch * group.size, 64)).astype(np.float32)
        y = rng.integers(0, 10, len(x))
        layers: list[nn.Module] = [nn.Linear(64, self.hidden, rng=rng), nn.Tanh()]
        for _ in range(2):
            layers += [nn.Linear(self.hidden, self.hidden, rng=rng), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(self.hidden, 10, rng=rng))
        times = _StepTimes()
        trainer = DistributedTrainer(model, lambda p: AdamW(p, lr=1e-3), nn.CrossEntropyLoss(), (x, y),
                                     batch_size=self.batch, group=group, progress=False, shuffle=False,
                                     callbacks=[times],
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
    parser.add_argument("--batch", type=int, default=8, help="samples per virtual rank and step")
    parser.add_argument("--configs", default="",
                        help="comma-separated row numbers of the table to run (0: none, 1: buddy every step, 2: every "
                             "10th, 3: daemon, 4: both; default all)")
    args = parser.parse_args()
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else list(CONFIGS)
    if chosen[0] is not CONFIGS[0]:
        chosen.insert(0, CONFIGS[0])  # the baseline every row is compared with
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    params = _params(args.hidden)
    copy_mb = 3 * params * 4 / args.world / 2**20
    print(f"{args.world} ranks on loopback, ZeRO-1 on {args.world} virtual ranks, MLP of {params:,} float32 parameters "
          f"({params * 4 / 2**20:.1f} MiB), AdamW, batch {args.batch} per virtual rank; {args.steps} steps x "
          f"{args.rounds} rounds; load average before: {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _, _ in chosen}
    for _ in range(args.rounds):
        for name, every, daemon in chosen:
            run = _Run(args.hidden, args.steps, every, daemon, args.batch)
            runs[name] += run_processes(run, args.world, timeout=600)
    print(f"load average after: {os.getloadavg()[0]:.1f}")

    def median(name: str, i: int) -> float:
        return float(statistics.median(r[i] for r in runs[name]))

    wall, cpu = median(CONFIGS[0][0], 0), median(CONFIGS[0][0], 1)
    print("| copies | median step (ms) | steps/s | vs none | CPU per step (ms) | vs none | "
          "copies on the training thread (ms/step) | daemon memcpy CPU (ms/step) | MB sent per step per rank | "
          "MB into daemon memory per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, every, daemon in chosen:
        w, c, b, m = median(name, 0), median(name, 1), median(name, 2), median(name, 3)
        copy = "0" if every is None else f"{copy_mb / every:.1f}"
        print(f"| {name} | {w * 1e3:.1f} | {1 / w:.2f} | {(w / wall - 1) * 100:+.1f} % | {c * 1e3:.1f} | "
              f"{(c / cpu - 1) * 100:+.1f} % | {b * 1e3:.2f} | {m * 1e3:.2f} | {copy} | "
              f"{copy_mb if daemon else 0:.1f} |", flush=True)
    seconds, rate = _memcpy(int(copy_mb * 2**20))
    print(f"memcpy on this machine: {rate / 1e9:.1f} GB/s of CPU time (np.copyto into a memfd mapping, median of 20): "
          f"one copy of {copy_mb:.1f} MB takes {seconds * 1e3:.2f} ms of CPU, {seconds / cpu * 100:.1f} % of the "
          "no-copy step's CPU time")


def _memcpy(nbytes: int) -> tuple[float, float]:
    """(CPU seconds, bytes per CPU second) of one `np.copyto` of `nbytes` from a process array into a mapped memfd
    (pages touched first); CPU time of the copying thread, as wall time on a loaded machine counts the waits for a
    core."""
    import mmap

    fd = os.memfd_create("axond-bench-memcpy")
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        dst = np.frombuffer(mapping, np.uint8)
        src = np.ones(nbytes, np.uint8)
        dst[:] = 0
        times = []
        for _ in range(20):
            began = time.thread_time()
            np.copyto(dst, src)
            times.append(time.thread_time() - began)
        del dst
        mapping.close()
    finally:
        os.close(fd)
    seconds = float(statistics.median(times))
    return seconds, nbytes / seconds


if __name__ == "__main__":
    main()
