"""Where the mpi backend's time per call goes: raw mpi4py forms of one collective, median us per call.

    mpirun --allow-run-as-root -n 2 --mca btl vader,self python bench/mpi_calls.py [--sizes 8 65536 1048576]

For each op (all_reduce, broadcast, all_gather, reduce_scatter) and size: the blocking call, the nonblocking call
with `Wait`, the nonblocking call polled with `Test` from Python (as the mpi backend polls, to the group's deadline),
and the same with a call check started beside it (an all_gather of 8 bytes per member, as the backend's). On two
ranks, all_gather also runs as the members swapping blocks as messages, and reduce_scatter as each member sending the
peer its block and adding the peer's into its own with NumPy (the backend's ways there, "swap+check"). A last line
times the call check's forms alone: an all_gather of an 8-byte digest, the 80-byte all_reduce it replaced, and a
barrier.
Every call follows a barrier; each form runs `--rounds` rounds and keeps its best median. Run it with the
environment the backend gives MPI (`OMPI_MCA_coll_libnbc_iallreduce_algorithm=1`: set here unless set already).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")
from mpi4py import MPI

comm, pairs = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
digest, digests = np.arange(1, dtype=np.int64), np.empty(size, np.int64)


def poll(requests: list[Any]) -> None:
    while not MPI.Request.Testall(requests):
        pass


def checked(start: Callable[[], list[Any]]) -> Callable[[], None]:
    return lambda: poll([comm.Iallgather(digest, digests), *start()])


def swap(x: np.ndarray, out: np.ndarray) -> list[Any]:
    n, peer = x.size, 1 - rank
    requests = [pairs.Irecv(out[peer * n:(peer + 1) * n], peer, 2), pairs.Isend(x, peer, 2)]
    out[rank * n:(rank + 1) * n] = x
    return requests


def forms(op: str, nbytes: int) -> dict[str, Callable[[], Any]]:
    count = max(nbytes // 4 // size * size, size)
    x = np.ones(count, np.float32)
    out = np.empty(count * size if op == "all_gather" else count // size, np.float32)
    blocking, start = {
        "all_reduce": (lambda: comm.Allreduce(MPI.IN_PLACE, x), lambda: [comm.Iallreduce(MPI.IN_PLACE, x)]),
        "broadcast": (lambda: comm.Bcast(x, 0), lambda: [comm.Ibcast(x, 0)]),
        "all_gather": (lambda: comm.Allgather(x, out), lambda: [comm.Iallgather(x, out)]),
        "reduce_scatter": (lambda: comm.Reduce_scatter_block(x, out), lambda: [comm.Ireduce_scatter_block(x, out)]),
    }[op]
    found: dict[str, Callable[[], Any]] = {"blocking": blocking, "I+Wait": lambda: MPI.Request.Waitall(start()),
                                           "I+Test": lambda: poll(start()), "I+Test+check": checked(start)}
    if op == "all_gather" and size == 2:
        found["swap+check"] = checked(lambda: swap(x, out))
    if op == "reduce_scatter" and size == 2:
        half = np.empty(count // 2, np.float32)

        def swap_reduce() -> None:
            half_n, peer = count // 2, 1 - rank
            poll([comm.Iallgather(digest, digests), pairs.Irecv(half, peer, 4),
                  pairs.Isend(x[peer * half_n:(peer + 1) * half_n], peer, 4)])
            np.add(x[rank * half_n:(rank + 1) * half_n], half, out=out)
        found["swap+check"] = swap_reduce
    return found


def timed(fns: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            times = []
            for _ in range(calls):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            best[name] = min(best[name], float(np.median(times)) * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 65536, 1048576])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        for nbytes in args.sizes:
            calls = 200 if nbytes <= 65536 else 50 if nbytes <= 1 << 20 else 8
            got = timed(forms(op, nbytes), calls, args.rounds)
            if rank == 0:
                print(f"{op} {nbytes} B: " + "  ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    sent, into = np.arange(10, dtype=np.int64), np.empty(10, np.int64)
    checks = {"all_gather 8 B": lambda: poll([comm.Iallgather(digest, digests)]),
              "all_reduce 80 B": lambda: poll([comm.Iallreduce(sent, into, MPI.MAX)]),
              "barrier": lambda: poll([comm.Ibarrier()])}
    got = timed(checks, 300, args.rounds)
    if rank == 0:
        print("call check alone: " + "  ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
