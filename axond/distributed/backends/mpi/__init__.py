"""The mpi backend: collectives over an MPI library through mpi4py (the `mpi` extra), for the fabrics MPI reaches.

    library.py   mpi4py, imported only when a group is made: availability, reduce ops, CUDA-aware MPI
    channel.py   `Channel`: a group's communicators and the template every op runs through (nonblocking requests
                 polled to the group's deadline, the call check, the abort messages)
    backend.py   `MpiBackend`: each op a short function over the channel
    plans.py     the prepared collectives: runners for the group's fast path, made once per op signature
    p2p.py       `PointToPoint`: send, recv and batches of them (a base of `MpiBackend`)
    options.py   `MpiOptions` (AXOND_MPI_*)

Importing this package imports no mpi4py; the registry finds `BACKEND` here and asks `is_available`.
"""

from axond.distributed.backends.mpi.backend import MpiBackend
from axond.distributed.backends.mpi.options import MpiOptions

BACKEND = MpiBackend

__all__ = ["BACKEND", "MpiBackend", "MpiOptions"]
