"""Where the mpi backend's time per call goes: raw mpi4py forms of one collective, median us per call.

    mpirun --allow-run-as-root -n 2 --mca btl vader,self python bench/mpi_calls.py [--sizes 8 65536 1048576]

For each op (all_reduce, broadcast, all_gather, reduce_scatter) and size: the blocking call; the nonblocking call
polled with `Test` from Python (as the mpi backend polls, to the group's deadline); "check, then I+Test": the call
check first (two ranks: an 8-byte digest each way as messages tagged with it; more: an all_gather of the digests),
then the nonblocking call polled, as the backend runs MPI's own ops; "check, then blocking": the same check and call
blocking, what a backend that ran MPI's blocking calls under a watchdog would run (docs/mpi.md). On two ranks,
"messages": the backend's form there (broadcast, all_gather: the data as one tagged message each way or one way plus
the digest back; reduce_scatter: each member's block sent to the peer and added with NumPy; all_reduce: the whole
array each way, added with NumPy, from 4 KiB a copy of it sent, which the backend runs up to 256 KiB and the ring
above; "messages, own array sent": the array itself sent, and the sum written into it). A last line times the call
check's forms alone.
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

from axond.distributed.backends.mpi.plans import REDUCE_BYTES

comm, pairs = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
digest, digests = np.arange(1, dtype=np.int64), np.empty(size, np.int64)


TAG = 77
token = np.zeros(1, np.int64)


def poll(requests: list[Any]) -> None:
    while not MPI.Request.Testall(requests):
        pass


def check() -> None:
    """The call check, completed: two ranks, the digest each way tagged with it; more, an all_gather of digests."""
    if size == 2:
        poll([pairs.Irecv(token, 1 - rank, TAG), pairs.Isend(digest, 1 - rank, TAG)])
    else:
        poll([comm.Iallgather(digest, digests)])


def blocking_check() -> None:
    if size == 2:
        pairs.Sendrecv(digest, 1 - rank, TAG, token, 1 - rank, TAG)
    else:
        comm.Allgather(digest, digests)


def messages(op: str, x: np.ndarray, out: np.ndarray) -> Callable[[], None] | None:
    """The backend's two-member form of `op` (tagged messages on `pairs`), or None where it runs MPI's op."""
    n, peer = x.size, 1 - rank
    if op == "all_gather":
        def gather() -> None:
            requests = [pairs.Irecv(out[peer * n:(peer + 1) * n], peer, TAG), pairs.Isend(x, peer, TAG)]
            out[rank * n:(rank + 1) * n] = x
            poll(requests)
        return gather
    if op == "broadcast":
        if rank == 0:
            return lambda: poll([pairs.Irecv(token, peer, TAG), pairs.Isend(x, peer, TAG)])
        return lambda: poll([pairs.Irecv(x, peer, TAG), pairs.Isend(digest, peer, TAG)])
    if op == "reduce_scatter":
        half = np.empty(n // 2, np.float32)

        def scatter() -> None:
            poll([pairs.Irecv(half, peer, TAG), pairs.Isend(x[peer * (n // 2):(peer + 1) * (n // 2)], peer, TAG)])
            np.add(x[rank * (n // 2):(rank + 1) * (n // 2)], half, out=out)
        return scatter
    theirs, copy = np.empty_like(x), np.empty_like(x)  # at any size: above COPY_REDUCE_BYTES, to show the ring wins

    def reduce() -> None:
        sent = x
        if x.nbytes > REDUCE_BYTES:  # the backend sends a copy there: the peer reads it where it lies
            copy[...] = x
            sent = copy
        poll([pairs.Irecv(theirs, peer, TAG), pairs.Isend(sent, peer, TAG)])
        np.add(x, theirs, out=x)
    return reduce


def own_array(x: np.ndarray) -> Callable[[], None]:
    """A two-member all_reduce as messages that sends the array itself and reduces into it (no copy)."""
    theirs, peer = np.empty_like(x), 1 - rank

    def reduce() -> None:
        poll([pairs.Irecv(theirs, peer, TAG), pairs.Isend(x, peer, TAG)])
        np.add(x, theirs, out=x)
    return reduce


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
    found: dict[str, Callable[[], Any]] = {
        "blocking": blocking, "I+Test": lambda: poll(start()),
        "check, then I+Test": lambda: (check(), poll(start())),
        "check, then blocking": lambda: (blocking_check(), blocking())}
    form = messages(op, x, out) if size == 2 else None
    if form is not None:
        found["messages"] = form
        if op == "all_reduce" and x.nbytes > REDUCE_BYTES:
            found["messages, own array sent"] = own_array(x)
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
    checks = {"tagged digest each way" if size == 2 else "all_gather of digests": check,
              "barrier": lambda: poll([comm.Ibarrier()])}
    got = timed(checks, 300, args.rounds)
    if rank == 0:
        print("call check alone: " + "  ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
