"""all_reduce of bfloat16 against float32 on thread ranks over loopback (tcp backend), median ms per call.

    python bench/low_precision.py [--nproc 2] [--mib 16] [--reps 7] [--sockets] [--processes]

Sizes: the same bytes (--mib of each dtype: twice the elements in bfloat16) and the same element count (the
float32 count in bfloat16: half the bytes). `--sockets` turns shared memory off (every byte through the
sockets, as between hosts). Ranks are threads of one process (sharing the interpreter's lock, which
ml_dtypes' casts hold), or with `--processes` real processes on loopback.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import axond
from axond.distributed.process_group import ProcessGroup
from axond.distributed import BackendOptions
from axond.distributed.backends.tcp import TcpOptions
from axond.testing import run_processes, run_threads


class _Rank:
    """Picklable per-rank entry point for run_processes (spawned children import this module)."""

    def __init__(self, count: int, dtype: str, reps: int, sockets: bool) -> None:
        self.args = (count, dtype, reps, sockets)

    def __call__(self) -> float:
        from axond.distributed import api

        count, dtype, reps, _ = self.args
        return timed(api.default_group(), count, np.dtype(axond.bfloat16 if dtype == "bfloat16" else dtype), reps)


def timed(g: ProcessGroup, count: int, dtype: np.dtype, reps: int) -> float:
    x = np.ones(count, dtype)
    g.all_reduce(x)  # warm-up: connections, arenas
    times = []
    for _ in range(reps):
        g.barrier()
        t = time.perf_counter()
        g.all_reduce(x)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sockets", action="store_true")
    ap.add_argument("--processes", action="store_true", help="ranks are processes instead of threads")
    a = ap.parse_args()
    f32, bf16 = np.dtype(np.float32), np.dtype(axond.bfloat16)
    n32 = a.mib * 2**20 // 4
    kind = "process" if a.processes else "thread"
    print(f"all_reduce SUM, {a.nproc} {kind} ranks, {'sockets only' if a.sockets else 'default transport'}")
    print("| dtype | elements | MiB | ms (median) |\n|---|---|---|---|")
    for dtype, count in ((f32, n32), (bf16, n32), (bf16, 2 * n32)):
        if a.processes:
            ms = max(run_processes(_Rank(count, dtype.name, a.reps, a.sockets), a.nproc, 600.0,
                                   env={"AXOND_SHM": "0"} if a.sockets else None))
        else:
            options = BackendOptions(timeout=600.0, tcp=TcpOptions(shm=False) if a.sockets else None)
            ms = max(run_threads(lambda g: timed(g, count, dtype, a.reps), a.nproc, 600.0, options=options))
        print(f"| {dtype} | {count} | {count * dtype.itemsize / 2**20:.0f} | {ms:.1f} |")


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
