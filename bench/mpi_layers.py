"""Where the mpi backend's time per call goes, layer by layer, in one MPI job of two ranks (median us per call).

    mpirun --allow-run-as-root -n 2 --mca btl vader,self python bench/mpi_layers.py [--sizes 65536 524288]

For broadcast and all_gather (zero-filled float32 arrays, as bench/collectives.py's; all_gather's size is one rank's
block): MPI's blocking call (raw mpi4py); the backend's two-member messages posted and polled from Python with no
axond code (`bare`, the call check in the tag); the backend's plan (`plans.duo_*`); its prepared runner (the call
check, the abort look); the group's method (the fast path); the module function. Calls run back to back, as in
bench/collectives.py; each layer keeps the median over ranks' slowest of `--calls` calls, best of `--rounds`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import axond
from axond.distributed.backends.mpi import plans
from axond.distributed.backends.mpi.channel import Check
from axond.distributed.ops import Op, dtype_code


def timed(comm: Any, fn: Callable[[], Any], calls: int) -> float:
    for _ in range(5):
        fn()
    comm.Barrier()
    times = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    every = np.empty((comm.Get_size(), calls))
    comm.Allgather(times, every)
    return float(np.median(every.max(axis=0))) * 1e6


def layers(op: str, nbytes: int, comm: Any, MPI: Any) -> dict[str, Callable[[], Any]]:
    group = axond.distributed.default_group()
    ch = group.backend.ch  # type: ignore[attr-defined]
    rank, peer, pairs, testall = ch.rank, ch.peer, ch.pairs, MPI.Request.Testall
    x = np.zeros(nbytes // 4, np.float32)
    n = x.size

    def poll(requests: list[Any]) -> None:
        while not testall(requests):
            pass

    if op == "broadcast":
        group.broadcast(x, 0)  # the full way once: the runner is kept
        runner = group.fast_path.runners()[("broadcast", x.dtype, n, 0)]
        checked = Check(ch, (int(Op.BROADCAST), dtype_code(x.dtype), n, 0, 0))  # as the backend's own (any alike)
        token, digest = np.zeros(1, np.int64), np.zeros(1, np.int64)
        if rank == 0:
            bare = lambda: poll([pairs.Irecv(token, peer, 77), pairs.Isend(x, peer, 77)])  # noqa: E731
        else:
            bare = lambda: poll([pairs.Irecv(x, peer, 77), pairs.Isend(digest, peer, 77)])  # noqa: E731
        return {"raw": lambda: comm.Bcast(x, 0), "bare": bare,
                "plan": lambda: plans.duo_broadcast(ch, checked, x, 0), "runner": lambda: runner(x, 0),
                "group": lambda: group.broadcast(x, 0), "module": lambda: axond.broadcast(x, 0)}
    out = np.zeros((2, n), np.float32)
    flat = out.reshape(-1)
    group.all_gather(x, out=out)
    runner = group.fast_path.runners()[("all_gather", x.dtype, n, None)]
    gathered = Check(ch, (int(Op.ALL_GATHER), dtype_code(x.dtype), n, 0, 0))

    def bare_gather() -> None:
        requests = [pairs.Irecv(flat[peer * n:(peer + 1) * n], peer, 77), pairs.Isend(x, peer, 77)]
        flat[rank * n:(rank + 1) * n] = x
        poll(requests)
    return {"raw": lambda: comm.Allgather(x, flat), "bare": bare_gather,
            "plan": lambda: plans.duo_all_gather(ch, gathered, x, flat), "runner": lambda: runner(x, out),
            "group": lambda: group.all_gather(x, out=out), "module": lambda: axond.all_gather(x, out=out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 524288])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    axond.init_process_group("mpi", 60.0)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() != 2:
        raise SystemExit("run it as two ranks: mpirun -n 2 python bench/mpi_layers.py")
    try:
        for op in ("broadcast", "all_gather"):
            for nbytes in args.sizes:
                forms = layers(op, nbytes, comm, MPI)
                best = {name: min(timed(comm, fn, args.calls) for _ in range(args.rounds))
                        for name, fn in forms.items()}
                if comm.Get_rank() == 0:
                    print(f"{op} {nbytes} B: " + "  ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
    finally:
        comm.Free()
        axond.destroy_process_group()


if __name__ == "__main__":
    main()
