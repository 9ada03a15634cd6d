"""What the in-memory copies of ZeRO-1 shards cost per step (not a test): steps/s and CPU time of
`DistributedTrainer(parallel="zero")` on virtual ranks with no copies, buddy copies after every step (`copy_every=1`)
and every 10th, copies into the worker daemon's memory after every step, and both.

    python bench/shard_copies.py --world 2 --hidden 1152 --steps 40 --rounds 3
    python bench/shard_copies.py --world 2 --hidden 1152 --steps 20 --rounds 3 --batch 1024   # more compute per step
    python bench/shard_copies.py --memcpy      # where one copy's time goes (no training)
    python bench/shard_copies.py --paired --batch 1024 --steps 40 --rounds 3   # the daemon copy, A/B within each run
    python bench/shard_copies.py --every 1,4,8 --hidden 1152 --batch 8 --steps 120 --rounds 8   # at copy_every=N

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
bandwidth of `np.copyto` of one rank's block into shared memory, and what one copy takes. Row 5 is the daemon copy
as it was first built (`np.copyto` per array instead of `host_copy.stream_copy`), for a before/after on one machine.
`--paired` measures the daemon copy A/B within each run, which a busy machine's load drifts cannot tilt: the rank
copies after every 4th step only, so of each 4 consecutive steps two carry a copy's CPU (it is posted at the end of
the first and runs into the second) and two none; a cell is the median over every block of every rank and round of
(CPU of the two steps with the copy - CPU of the two without), against the CPU of a step without. `--memcpy` prints
instead where one copy's CPU time goes: into a fresh mapping (page faults on first touch) or one faulted in once, from
a source in cache or out of it, with NumPy's copy (glibc's memcpy) or with non-temporal stores, and how long the
hand-off to the background thread takes. `--paired --paired-modes buddy` measures the buddy copy the same way (sent
after every 4th step only, with no gradients kept between); `relayed` the daemon copy with the buddy copy sent from it
by the rank's worker to the buddy's worker (`axond.worker.copy_forward`, `axond.worker.buddy_relay`; here this process
plays every rank's worker, and its CPU per copy sent and received is printed apart). `--every 1,4,8` runs both copies
through the workers at their real cadence, `copy_every=N` (the daemon copy and the buddy's after every N-th step, the
buddy keeping its sources' gradients between), against no copies at all, the configurations interleaved as above; a
cell is the median CPU per step of every rank and round. `--pin` puts every rank on the first CPU and this process (the
workers' side) on the others: a node with a core to spare for its worker daemon, which a 2-core machine otherwise
lacks.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from axond import nn
from axond.distributed import default_group
from axond.distributed.backends.host_copy import stream_copy
from axond.nn.optim import AdamW
from axond.testing import run_processes
from axond.train import Callback, DistributedTrainer, buddy, daemon_copy
from axond.worker.buddy_relay import BuddyRelay
from axond.worker.copy_forward import Forwarder

RELAY_SECRET = b"axond-bench-relay"

CONFIGS: tuple[tuple[str, int | None, str], ...] = (
    ("none", None, ""),
    ("buddy every step (copy_every=1)", 1, ""),
    ("buddy every 10th step (copy_every=10)", 10, ""),
    ("daemon every step", None, "stream"),
    ("buddy + daemon every step", 1, "stream"),
    ("daemon every step, np.copyto (before)", None, "copyto"),
)
"""(name, copy_every, copies into daemon memory: "" none, "stream" as built, "copyto" with NumPy's copy)."""


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


class _BlockTimes(Callback):
    """CPU time (every thread of the process) and wall time of each step, for `--paired`."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.last = (0.0, 0.0)

    def on_step_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        now = (time.process_time(), time.perf_counter())
        self.cpu.append(now[0] - self.last[0])
        self.wall.append(now[1] - self.last[1])
        self.last = now


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
    daemon: str
    batch: int
    relays: tuple[str, ...] = ()
    """Per rank: its worker's relay (`axond.worker.buddy_relay`, run by the bench's parent process, as its forwarder),
    for `paired-relayed`; the parent's fds of each rank's held memory, shard memory and forward pipe, and its pid."""
    held: tuple[int, ...] = ()
    memory: tuple[int, ...] = ()
    forward: tuple[int, ...] = ()
    parent: int = 0
    pin: int | None = None
    """Run this rank on this CPU only (`--pin`)."""

    def __call__(self) -> Any:
        if self.pin is not None:
            os.sched_setaffinity(0, {self.pin})
        group = default_group()
        os.environ.pop("AXOND_SHARD_MEMORY_FD", None)
        for var in ("AXOND_COPY_RELAY", "AXOND_HELD_MEMORY_FD", "AXOND_COPY_FORWARD_FD"):
            os.environ.pop(var, None)
        # what `axond worker` hands its rank: a memfd it inherits (with relays: the parent's, below)
        if self.daemon and not self.relays and self.daemon != "paired-buddy":
            os.environ["AXOND_SHARD_MEMORY_FD"] = str(os.memfd_create("axond-bench-shards"))
        if self.relays:  # the parent plays each rank's worker: its memory, the forward pipe, the relay, held memory
            r = group.rank

            def parents(fd: int, flags: int) -> str:
                return str(os.open(f"/proc/{self.parent}/fd/{fd}", flags))

            os.environ["AXOND_SHARD_MEMORY_FD"] = parents(self.memory[r], os.O_RDWR)
            os.environ["AXOND_COPY_FORWARD_FD"] = parents(self.forward[r], os.O_WRONLY)
            os.environ["AXOND_HELD_MEMORY_FD"] = parents(self.held[r], os.O_RDWR)
            os.environ["AXOND_COPY_RELAY"] = self.relays[r]
        if self.daemon.endswith("copyto"):  # the copy as first built, for the before/after
            daemon_copy.stream_copy = np.copyto
        if self.daemon.startswith("paired"):  # a copy after every 4th step only: 4b and 4b + 1 carry it
            post = daemon_copy.DaemonCopy.post

            def fourth(copy: daemon_copy.DaemonCopy, lineage: int) -> None:
                if copy.zero.tag % 4 == 0:
                    post(copy, lineage)

            setattr(daemon_copy.DaemonCopy, "post", fourth)
        if self.daemon in ("paired-buddy", "paired-both", "paired-relayed"):  # the buddy copy after every 4th step
            setattr(buddy.BuddyCopies, "due", lambda copies: copies.zero.tag % 4 == 0)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.steps * self.batch * group.size, 64)).astype(np.float32)
        y = rng.integers(0, 10, len(x))
        layers: list[nn.Module] = [nn.Linear(64, self.hidden, rng=rng), nn.Tanh()]
        for _ in range(2):
            layers += [nn.Linear(self.hidden, self.hidden, rng=rng), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(self.hidden, 10, rng=rng))
        times = _BlockTimes() if self.daemon.startswith("paired") else _StepTimes()
        trainer = DistributedTrainer(model, lambda p: AdamW(p, lr=1e-3), nn.CrossEntropyLoss(), (x, y),
                                     batch_size=self.batch, group=group, progress=False, shuffle=False,
                                     callbacks=[times],
                                     parallel="zero", virtual_ranks=group.size, copy_every=self.copy_every)
        if isinstance(times, _BlockTimes):
            times.last = (time.process_time(), time.perf_counter())
            trainer.fit(1)
            return _blocks(times)
        times.last = time.perf_counter()
        trainer.fit(1)
        return times.result(trainer)


def _blocks(times: _BlockTimes) -> list[tuple[float, float, float, float]]:
    """Per block of 4 steps after the first (steps numbered from 1: step 4b ends with the copy posted): (CPU of a step
    without a copy, the extra CPU of the two steps with it, wall of a step without, the extra wall)."""
    cpu, wall = times.cpu, times.wall
    return [((cpu[i + 1] + cpu[i + 2]) / 2, cpu[i - 1] + cpu[i] - cpu[i + 1] - cpu[i + 2],
             (wall[i + 1] + wall[i + 2]) / 2, wall[i - 1] + wall[i] - wall[i + 1] - wall[i + 2])
            for i in range(4, len(cpu) - 3, 4)]  # index i is step i + 1: block b is indices 4b - 1 .. 4b + 2


def _params(hidden: int) -> int:
    return 64 * hidden + hidden + 2 * (hidden * hidden + hidden) + hidden * 10 + 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="samples per virtual rank and step")
    parser.add_argument("--configs", default="0,1,2,3,4",
                        help="comma-separated row numbers of the table to run (0: none, 1: buddy every step, 2: every "
                             "10th, 3: daemon, 4: both, 5: daemon with np.copyto, as first built; default 0-4)")
    parser.add_argument("--memcpy", action="store_true", help="only the breakdown of one copy's CPU time")
    parser.add_argument("--paired", action="store_true", help="only the daemon copy, A/B within each run (a copy "
                        "after every 4th step)")
    parser.add_argument("--paired-modes", default="stream,copyto",
                        help="with --paired: the copies to measure, of stream (the daemon copy as built), copyto (with "
                             "np.copyto, as first built), buddy (the buddy copy), both")
    parser.add_argument("--pin", action="store_true", help="with --every: every rank on the first CPU, the workers' "
                        "side (this process) on the others: a node with a core to spare for its worker daemon")
    parser.add_argument("--every", default="", help="only both copies through the workers at their real cadence, "
                        "for each comma-separated copy_every (e.g. 1,4,8), against no copies (CPU per step)")
    args = parser.parse_args()
    params = _params(args.hidden)
    copy_mb = 3 * params * 4 / args.world / 2**20
    if args.memcpy:
        _memcpy_table(int(copy_mb * 2**20))
        return
    if args.paired:
        _paired(args, params, copy_mb)
        return
    if args.every:
        _amortized(args, params, copy_mb)
        return
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")]
    if chosen[0] is not CONFIGS[0]:
        chosen.insert(0, CONFIGS[0])  # the baseline every row is compared with
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
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
          "copies on the training thread (ms/step) | daemon copy CPU (ms/step) | daemon copy CPU / none's CPU | "
          "MB sent per step per rank | MB into daemon memory per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, every, daemon in chosen:
        w, c, b, m = median(name, 0), median(name, 1), median(name, 2), median(name, 3)
        copy = "0" if every is None else f"{copy_mb / every:.1f}"
        print(f"| {name} | {w * 1e3:.1f} | {1 / w:.2f} | {(w / wall - 1) * 100:+.1f} % | {c * 1e3:.1f} | "
              f"{(c / cpu - 1) * 100:+.1f} % | {b * 1e3:.2f} | {m * 1e3:.2f} | {m / cpu * 100:.1f} % | {copy} | "
              f"{copy_mb if daemon else 0:.1f} |", flush=True)
    seconds, rate = _memcpy(int(copy_mb * 2**20))
    print(f"memcpy on this machine: {rate / 1e9:.1f} GB/s of CPU time (np.copyto into a memfd mapping, median of 20): "
          f"one copy of {copy_mb:.1f} MB takes {seconds * 1e3:.2f} ms of CPU, {seconds / cpu * 100:.1f} % of the "
          "no-copy step's CPU time")


class _Workers:
    """This process playing each rank's worker for the copies through the workers: a relay (`BuddyRelay`), the rank's
    memory and a forwarder (`Forwarder`) per rank; `run` passes them to the ranks, `close` ends them and returns the
    workers' CPU per copy (sending, receiving)."""

    def __init__(self, world: int) -> None:
        self.relays = [BuddyRelay("127.0.0.1") for _ in range(world)]
        self.memories = [os.memfd_create("axond-bench-shards") for _ in self.relays]
        self.forwarders = [Forwarder(m, 0, i, lambda: RELAY_SECRET) for i, m in enumerate(self.memories)]
        for r in self.relays:
            r.admit(RELAY_SECRET)

    def fields(self) -> dict[str, Any]:
        return dict(relays=tuple(r.address for r in self.relays), held=tuple(r.held.fd for r in self.relays),
                    memory=tuple(self.memories), forward=tuple(f.write_fd for f in self.forwarders),
                    parent=os.getpid())

    def close(self) -> tuple[float, float]:
        kept = max(sum(r.kept for r in self.relays), 1)
        cpu = (sum(f.send_cpu_s for f in self.forwarders) / kept, sum(r.receive_cpu_s for r in self.relays) / kept)
        for f in self.forwarders:
            f.close()
        for r in self.relays:
            r.close()
        for m in self.memories:
            os.close(m)
        return cpu


def _amortized(args: argparse.Namespace, params: int, copy_mb: float) -> None:
    """Both copies through the workers at their real cadence (`copy_every=N`: the daemon copy and the buddy's after
    every N-th step, the buddy keeping the gradients between), against no copies at all, rounds interleaved."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    everys = [int(e) for e in args.every.split(",")]
    print(f"{args.world} ranks on loopback, ZeRO-1 on {args.world} virtual ranks, MLP of {params:,} float32 parameters "
          f"({params * 4 / 2**20:.1f} MiB), AdamW, batch {args.batch} per virtual rank; both copies of {copy_mb:.1f} "
          f"MiB through the workers every N-th of {args.steps} steps, {args.rounds} rounds; load average before: "
          f"{os.getloadavg()[0]:.1f}")
    pin = None
    if args.pin:  # the ranks on the first CPU, this process (the workers' relays and forwarders) on the others
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs two CPUs or more")
        os.sched_setaffinity(0, set(cpus[1:]))
        pin = cpus[0]
        print(f"pinned: every rank on CPU {pin}, the workers' side on CPU(s) {cpus[1:]}")
    names = ["none", *[f"copy_every={n}" for n in everys]]
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    workers_cpu: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        for name, every in zip(names, [None, *everys]):
            if every is None:
                runs[name] += run_processes(_Run(args.hidden, args.steps, None, "", args.batch, pin=pin),
                                            args.world, timeout=600)
                continue
            workers = _Workers(args.world)
            try:
                run = _Run(args.hidden, args.steps, every, "relayed", args.batch, **workers.fields(), pin=pin)
                runs[name] += run_processes(run, args.world, timeout=600)
            finally:
                workers_cpu.append(workers.close())
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    send, receive = (statistics.median(c[i] for c in workers_cpu) * 1e3 for i in range(2))
    print(f"the workers' side (this process): {send:.2f} ms sending and {receive:.2f} ms receiving per copy")

    def median(name: str, i: int) -> float:
        return float(statistics.median(r[i] for r in runs[name]))

    cpu = median("none", 1)
    print("| copies | batch per rank | CPU per step (ms), median | vs none | quartiles of the ranks' runs (ms) | "
          "median wall step (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        c = median(name, 1)
        low, _, high = statistics.quantiles([r[1] for r in runs[name]], n=4)
        print(f"| {name} | {args.batch} | {c * 1e3:.2f} | {(c / cpu - 1) * 100:+.1f} % | {low * 1e3:.1f} to "
              f"{high * 1e3:.1f} | {median(name, 0) * 1e3:.1f} |", flush=True)


def _paired(args: argparse.Namespace, params: int, copy_mb: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    print(f"{args.world} ranks on loopback, ZeRO-1 on {args.world} virtual ranks, MLP of {params:,} float32 parameters "
          f"({params * 4 / 2**20:.1f} MiB), AdamW, batch {args.batch} per virtual rank; a copy of {copy_mb:.1f} "
          f"MiB after every 4th of {args.steps} steps, {args.rounds} rounds; load average before: "
          f"{os.getloadavg()[0]:.1f}")
    names = {"stream": "daemon, stream_copy (as built)", "copyto": "daemon, np.copyto (before)",
             "buddy": "buddy (copy_every=1), rank to rank", "both": "buddy rank to rank + daemon",
             "relayed": "buddy through the workers' relays + daemon"}
    modes = {f"paired-{m}" if m != "stream" else "paired": names[m] for m in args.paired_modes.split(",")}
    blocks: dict[str, list[tuple[float, float, float, float]]] = {mode: [] for mode in modes}
    relay_cpu: list[float] = []
    forward_cpu: list[float] = []
    for _ in range(args.rounds):  # interleaved, as the main table
        for mode in modes:
            workers = _Workers(args.world) if mode == "paired-relayed" else None
            run = _Run(args.hidden, args.steps, 1 if mode in ("paired-buddy", "paired-both", "paired-relayed")
                       else None, mode, args.batch, **(workers.fields() if workers is not None else {}))
            try:
                for rank in run_processes(run, args.world, timeout=600):
                    blocks[mode] += rank
            finally:
                if workers is not None:  # the workers' side: sending and receiving every copy (this process's threads)
                    send, receive = workers.close()
                    forward_cpu.append(send)
                    relay_cpu.append(receive)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if relay_cpu:
        print(f"the workers' side (another process): sending {statistics.median(forward_cpu) * 1e3:.2f} ms and "
              f"receiving {statistics.median(relay_cpu) * 1e3:.2f} ms of CPU per copy (their threads' CPU time, median "
              "over rounds)")
    print("| copy | batch per rank | blocks | CPU per step without a copy (ms) | CPU a copy adds (ms), median "
          "(quartiles) | vs the step | wall per step without (ms) | wall a copy adds (ms) | vs the step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, name in modes.items():
        rows = blocks[mode]
        cpu, extra, wall, wall_extra = (float(statistics.median(r[i] for r in rows)) for i in range(4))
        low, _, high = statistics.quantiles([r[1] for r in rows], n=4)
        print(f"| {name} | {args.batch} | {len(rows)} | {cpu * 1e3:.1f} | {extra * 1e3:.2f} ({low * 1e3:.1f} to "
              f"{high * 1e3:.1f}) | {extra / cpu * 100:+.1f} % | {wall * 1e3:.1f} | {wall_extra * 1e3:.2f} | "
              f"{wall_extra / wall * 100:+.1f} % |", flush=True)


def _memcpy_table(nbytes: int) -> None:
    """Where one daemon copy of `nbytes` (one rank's block) spends its CPU time: page faults, the cache, the stores."""
    src = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    thirds = [src[k * len(src) // 3 : (k + 1) * len(src) // 3] for k in range(3)]
    sweep = np.ones(256 * 2**20 // 8)  # read and written between copies: the source is out of cache, as after a step

    def mapping(populate: bool) -> tuple[int, mmap.mmap, np.ndarray]:
        fd = os.memfd_create("axond-bench-memcpy")
        os.ftruncate(fd, src.nbytes)
        os.posix_fallocate(fd, 0, src.nbytes)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        m = mmap.mmap(fd, src.nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        return fd, m, np.frombuffer(m, np.float32)

    def first(populate: bool) -> float:
        times = []
        for _ in range(5):
            fd, m, dst = mapping(populate)
            began = time.thread_time()
            np.copyto(dst, src)
            times.append(time.thread_time() - began)
            del dst
            m.close()
            os.close(fd)
        return float(statistics.median(times))

    fd, m, dst = mapping(True)
    try:
        rows = [("np.copyto into a fresh mapping: its first copy (a page fault per 4 KiB)", first(False)),
                ("np.copyto into a mapping made with MAP_POPULATE: its first copy", first(True)),
                *_warm_and_cold(dst, src, thirds, sweep), *_handoff(dst, src)]
    finally:
        del dst
        m.close()
        os.close(fd)
    print(f"one copy of {nbytes / 2**20:.1f} MiB into a memfd mapping, CPU time of the copying thread, median; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| copy | ms of CPU | GB/s |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        rate = f"{nbytes / seconds / 1e9:.1f}" if not name.startswith("(wall)") else "-"
        print(f"| {name} | {seconds * 1e3:.2f} | {rate} |")


def _warm_and_cold(dst: np.ndarray, src: np.ndarray, thirds: list[np.ndarray],
                   sweep: np.ndarray) -> list[tuple[str, float]]:
    """Copies into a mapping whose pages are in, from a source in cache or not (`sweep` read and written first)."""
    parts = [dst[k * len(dst) // 3 : (k + 1) * len(dst) // 3] for k in range(3)]

    def timed(copy: Any, cold: bool) -> float:
        times = []
        for _ in range(9):
            if cold:
                sweep[:] += 1.0
            began = time.thread_time()
            copy()
            times.append(time.thread_time() - began)
        return float(statistics.median(times))

    return [
        ("np.copyto, pages faulted in, source in cache", timed(partial(np.copyto, dst, src), False)),
        ("np.copyto, pages faulted in, source out of cache", timed(partial(np.copyto, dst, src), True)),
        ("np.copyto of three arrays (parameters, two moments), source out of cache",
         timed(lambda: [np.copyto(d, s) for d, s in zip(parts, thirds)], True)),
        ("stream_copy (non-temporal stores), source in cache", timed(partial(stream_copy, dst, src), False)),
        ("stream_copy, source out of cache", timed(partial(stream_copy, dst, src), True)),
        ("stream_copy of three arrays, source out of cache",
         timed(lambda: [stream_copy(d, s) for d, s in zip(parts, thirds)], True)),
    ]


def _handoff(dst: np.ndarray, src: np.ndarray) -> list[tuple[str, float]]:
    """Wall time from handing the copy to a background thread (as `DaemonCopy.post`) to the copy starting, with the
    training thread asleep or busy with small NumPy operations that hold the interpreter lock (a small-batch step)."""
    pool = ThreadPoolExecutor(1)
    began: list[float] = []
    a = np.ones((8, 1152), np.float32)
    w = np.full((1152, 1152), 1e-3, np.float32)

    def job() -> None:
        began.append(time.perf_counter())
        stream_copy(dst, src)

    def handed(busy: bool) -> float:
        waits = []
        for _ in range(9):
            posted = time.perf_counter()
            done = pool.submit(job)
            if busy:
                while time.perf_counter() < posted + 0.05:
                    np.tanh(a @ w, out=a)
            else:
                time.sleep(0.05)
            done.result()
            waits.append(began[-1] - posted)
        return float(statistics.median(waits))

    try:
        return [("(wall) hand-off to the background thread until the copy starts, training thread asleep",
                 handed(False)),
                ("(wall) the same, training thread busy in small NumPy operations (it holds the interpreter lock)",
                 handed(True))]
    finally:
        pool.shutdown()


def _memcpy(nbytes: int) -> tuple[float, float]:
    """(CPU seconds, bytes per CPU second) of one `np.copyto` of `nbytes` from a process array into a mapped memfd
    (pages touched first); CPU time of the copying thread, as wall time on a loaded machine counts the waits for a
    core."""
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
