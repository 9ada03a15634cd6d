"""The host bound of a collective on one machine whose ranks share its cores (the loopback case).

Over loopback TCP every byte a rank sends costs two kernel copies (into the socket buffer, out of
it), done by the cores of the same machine, and every reduction costs an in-place add. When the
ranks are at least as many as the cores, the cores are the bottleneck, whatever the algorithm:

- The raw duplex test (two processes streaming both ways at once, which keeps two cores busy)
  moves `raw` GB/s per direction: each busy core moves `raw` GB/s of traffic.
- An op moves T bytes in total over all of its links and reduces A bytes (the whole machine's
  work; the algorithm cannot lower either below these minima):

  | op | T | A |
  |---|---|---|
  | all_reduce | 2 (n-1) N | (n-1) N |
  | reduce_scatter | (n-1) N | (n-1) N |
  | all_gather, broadcast | (n-1) N | 0 |

  (N as in nccl-tests: the all_reduce/broadcast array, the all_gather output, the reduce_scatter input.)
- So time >= (T / raw + A / add_rate) / cores, and the busbw bound follows from the op's bus factor.

At n = 2 with two cores and no reduction cost this is the raw limit itself; at n = 4 on two cores
an all_reduce is bounded by raw / 2. The bound is an estimate: cache-resident sizes can copy faster
than the raw test's streaming buffers, so a measured busbw may exceed it at small sizes.
"""

from __future__ import annotations

import os
import time

import numpy as np

CHUNK_BYTES = 1 << 20
"""Reductions add a received chunk of this size (cache-resident) into the array, as the TCP backend does."""


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def traffic(op: str, n: int, nbytes: int) -> tuple[float, float]:
    """(T, A): the bytes all links carry in total and the bytes reduced, over the whole machine."""
    if op == "all_reduce":
        return 2.0 * (n - 1) * nbytes, float((n - 1) * nbytes)
    if op == "reduce_scatter":
        return float((n - 1) * nbytes), float((n - 1) * nbytes)
    if op in ("all_gather", "broadcast"):
        return float((n - 1) * nbytes), 0.0
    raise ValueError(f"no bound for op {op!r}")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def host_bound(op: str, n: int, nbytes: int, raw_gbs: float, add_gbs: float | None, ncores: int) -> float | None:
    """Upper estimate of busbw (GB/s) of `op` on `n` ranks sharing `ncores` cores (None when n < ncores:
    then the cores are not all busy copying and this model does not apply)."""
    if n < 2 or n < ncores or raw_gbs <= 0:
        return None
    t_bytes, a_bytes = traffic(op, n, nbytes)
    cpu = t_bytes / (raw_gbs * 1e9)
    if a_bytes:
        if not add_gbs:
            return None
        cpu += a_bytes / (add_gbs * 1e9)
    seconds = cpu / ncores
    return nbytes / seconds / 1e9 * bus_factor(op, n)


def add_rate(nbytes: int, repeat: int = 3) -> float:
    """GB/s of one core adding 1 MiB float32 chunks into an array of `nbytes` in place (best of `repeat`)."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    step = CHUNK_BYTES // 4
    tmp = np.ones(step, np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for s in range(0, x.size, step):
            e = min(s + step, x.size)
            np.add(x[s:e], tmp[: e - s], out=x[s:e])
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9
