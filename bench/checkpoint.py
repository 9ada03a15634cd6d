"""Checkpoint benchmark (not a test): save/load throughput against the disk, and the training stall of async_save.

    python bench/checkpoint.py [--world 2] [--mb 128] [--dir DIR] [--repeat 3]

Ranks are real processes on loopback over the TCP backend (axond.testing.run_processes). Each
rank holds `--mb` MiB of float32 state as FSDP-style flat shards of global tensors (no two ranks
hold the same bytes, so every byte is written once). Measured in the same run, on the same file
system (`--dir`, default a temporary directory):
- raw: every rank writes the same arrays to its own file (one write each, then fsync), at the same
  time: what the disk gives parallel writers (after one untimed warm-up; raw and save alternate first);
- save / load: `axond.checkpoint.save` and `load` of that state (plan exchange, CRC32 per piece,
  fsync, metadata, atomic rename; load reads, checks CRC32 and copies into the live arrays);
- stall (median of 3): how long a training loop (DDP, AdamW, the example MLP) is blocked by a checkpoint of its
  own state: `save` blocks until committed, `async_save` only while staging the copy.
Throughput is GB/s (1e9 bytes/s): per rank (its bytes / its time) and total (all bytes / slowest rank).
The page cache may serve loads from memory; the numbers say what this machine does, not what a disk does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import axond
import axond.checkpoint as ckpt
from axond.checkpoint import ShardedTensor
from axond.testing import run_processes

TENSORS = 8


def _state(mb: int, rank: int, world: int) -> dict[str, Any]:
    """`mb` MiB per rank: TENSORS global tensors, each split into `world` flat ranges (this rank's range)."""
    per = mb * (1 << 20) // 4 // TENSORS
    rng = np.random.default_rng(rank)
    out = {}
    for i in range(TENSORS):
        local = rng.standard_normal(per, dtype=np.float32)
        out[f"w{i}"] = ShardedTensor.from_flat_range((world, per), rank * per, local)
    return {"model": out}


def _fsync_write(path: Path, pieces: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for data in pieces:
            f.write(data.data)
        f.flush()
        os.fsync(f.fileno())


def _throughput(mb: int, root: str, repeat: int) -> dict[str, float]:
    g = axond.distributed.api.default_group()
    rank, world = g.rank, g.size
    state = _state(mb, rank, world)
    nbytes = mb * (1 << 20)
    pieces = [c.array for t in state["model"].values() for c in t.chunks]
    times: dict[str, list[float]] = {"raw": [], "save": [], "load": []}
    _fsync_write(Path(root) / f"warm.{rank}", pieces)  # first touches of the file system's pages: not timed
    ckpt.save(state, Path(root) / "warm", g)
    os.unlink(Path(root) / f"warm.{rank}")
    def timed_raw(r: int) -> None:
        g.barrier()
        t0 = time.perf_counter()
        _fsync_write(Path(root) / f"raw.{rank}.{r}", pieces)
        times["raw"].append(time.perf_counter() - t0)
        os.unlink(Path(root) / f"raw.{rank}.{r}")

    def timed_save(r: int) -> None:
        g.barrier()
        t0 = time.perf_counter()
        ckpt.save(state, Path(root) / f"c{r}", g)
        times["save"].append(time.perf_counter() - t0)

    for r in range(repeat):  # alternating which goes first, so neither inherits the other's dirty pages
        for fn in (timed_raw, timed_save) if r % 2 == 0 else (timed_save, timed_raw):
            fn(r)
        g.barrier()
        t0 = time.perf_counter()
        ckpt.load(state, Path(root) / f"c{r}", g)
        times["load"].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()} | {"bytes": float(nbytes)}


def _stall(root: str, hidden: int, steps: int) -> dict[str, float]:
    from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
    from axond.nn import CrossEntropyLoss
    from axond.nn.optim import AdamW
    from axond.parallel import DDP

    g = axond.distributed.api.default_group()
    cfg = TrainConfig(hidden=hidden, depth=2, samples=2048)
    x, y, _, _ = make_dataset(cfg)
    model = DDP(build_model(cfg), g)
    opt = AdamW(list(model.module.parameters()), lr=1e-3)
    loss = CrossEntropyLoss()

    def step(i: int) -> None:
        rows = slice((i * 64) % 2048, (i * 64) % 2048 + 64)
        opt.zero_grad()
        loss(model(x[rows]), y[rows])
        model.backward(loss.backward())
        opt.step()

    for i in range(3):
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    step_s = (time.perf_counter() - t0) / steps
    model_sd, optim_sd = ckpt.get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    sync, stage, overlapped = [], [], []
    for r in range(3):
        t0 = time.perf_counter()
        ckpt.save(state, Path(root) / f"sync{r}", g)
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        future = ckpt.async_save(state, Path(root) / f"async{r}", g)
        stage.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        overlapped.append((time.perf_counter() - t0) / steps)
        future.result(timeout=300)
    copy = [np.array(a, copy=True) for a in model_sd.values()]
    t0 = time.perf_counter()
    for _ in range(3):
        copy = [np.array(a, copy=True) for t in (model_sd, *optim_sd["state"].values()) for a in t.values()
                if hasattr(a, "shape")]
    memcpy_s = (time.perf_counter() - t0) / 3
    del copy
    sync_s, async_s, overlapped_step_s = float(np.median(sync)), float(np.median(stage)), float(np.median(overlapped))
    nbytes = sum(p.data.nbytes for p in model.module.parameters()) * 3  # parameters + two AdamW moments
    return {"step": step_s, "sync": sync_s, "async": async_s, "overlapped_step": overlapped_step_s,
            "memcpy": memcpy_s, "bytes": float(nbytes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/checkpoint.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mb", type=int, default=128, help="MiB of state per rank")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024, help="MLP width for the stall measurement")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="axond-ckpt-bench-", dir=a.dir) as root:
        res = run_processes(_Throughput(a.mb, root, a.repeat), a.world, timeout=600)
        total = res[0]["bytes"] * a.world / 1e9
        print(f"world {a.world}, {a.mb} MiB per rank ({total:.2f} GB total), median of {a.repeat}, in {root}")
        print(f"{'':6} {'per rank GB/s':>14} {'total GB/s':>11} {'vs raw':>7}")
        raw_total = total / max(r["raw"] for r in res)
        for what in ("raw", "save", "load"):
            per = np.mean([r["bytes"] / 1e9 / r[what] for r in res])
            tot = total / max(r[what] for r in res)
            print(f"{what:6} {per:14.2f} {tot:11.2f} {tot / raw_total:7.2f}")
        st = run_processes(_Stall(root, a.hidden, 10), a.world, timeout=600)[0]
        print(f"\ntraining stall, MLP {a.hidden}x3 + AdamW ({st['bytes'] / 1e6:.0f} MB of state), "
              f"step {st['step'] * 1e3:.1f} ms:")
        print(f"  save       blocks {st['sync'] * 1e3:8.1f} ms")
        print(f"  async_save blocks {st['async'] * 1e3:8.1f} ms (plan exchange + staging copy; a bare copy of the "
              f"state takes {st['memcpy'] * 1e3:.1f} ms); steps while it writes: {st['overlapped_step'] * 1e3:.1f} ms")
    return 0


class _Throughput:
    """Picklable entry point of the throughput ranks."""

    def __init__(self, mb: int, root: str, repeat: int) -> None:
        self.mb, self.root, self.repeat = mb, root, repeat

    def __call__(self) -> dict[str, float]:
        return _throughput(self.mb, self.root, self.repeat)


class _Stall:
    def __init__(self, root: str, hidden: int, steps: int) -> None:
        self.root, self.hidden, self.steps = root, hidden, steps

    def __call__(self) -> dict[str, float]:
        return _stall(self.root, self.hidden, self.steps)


if __name__ == "__main__":
    sys.exit(main())
