"""Does the MPI library write past the end of a receive that is too short for the message? (Open MPI here: yes.)

    mpirun --allow-run-as-root -n 2 --mca btl vader,self python bench/mpi_truncation.py
    mpirun --allow-run-as-root -n 3 --oversubscribe --mca btl vader,self python bench/mpi_truncation.py

Two ranks: rank 0 sends messages of 64 B to 1 MiB; rank 1 receives each into the first 8 bytes of a zeroed 2 MiB
array and counts the bytes written past them. Three ranks and more: the last rank runs MPI_Ibcast and MPI_Iallgather
of 1 MiB per rank, the others of 8 KiB, into the start of zeroed arrays; each rank counts the elements written past
its own. MPI must fail such a receive with MPI_ERR_TRUNCATE and write no more than the buffer holds; where it writes
more, a peer's call of another size, started before the members compared their calls, overwrites memory. This is why
the mpi backend checks each call before MPI's op starts (docs/mpi.md).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()


def poll(request: MPI.Request) -> str:
    deadline = time.monotonic() + 5
    try:
        while not request.Test():
            if time.monotonic() > deadline:
                return "still pending after 5 s"
    except MPI.Exception as e:
        return f"MPI error {e.Get_error_string()}"
    return "completed"


def messages() -> None:
    for n in (64, 4096, 65536, 1 << 20):
        if rank == 0:
            comm.Isend(np.ones(n, np.uint8), 1, 5).Wait()
        else:
            big = np.zeros(2 << 20, np.uint8)
            how = poll(comm.Irecv(big[:8], 0, MPI.ANY_TAG))
            print(f"{n} B message into an 8 B receive: {how}; bytes written past it: {int(big[8:].sum())}", flush=True)
        comm.Barrier()


def collectives() -> None:
    count = (1 << 18) if rank == size - 1 else 2048
    for name in ("Ibcast", "Iallgather"):
        whole = np.zeros((4 << 20) * size, np.float32)
        x = np.ones(count, np.float32)
        if name == "Ibcast":
            x = whole[:count]
            x[...] = 1
            how, mine = poll(comm.Ibcast(x, size - 1)), count
        else:
            how, mine = poll(comm.Iallgather(x, whole[:count * size])), count * size
        print(f"rank {rank} {name} of {count * 4} B per rank: {how}; elements written past its own: "
              f"{int((whole[mine:] != 0).sum())}", flush=True)
        comm.Barrier()


if __name__ == "__main__":
    messages() if size == 2 else collectives()
