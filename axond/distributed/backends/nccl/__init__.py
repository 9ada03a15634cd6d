"""The NCCL backend (GPU): `backend` (the communicator and its launch template), `ops` (each op a function over it),
`work` (an op's completion), `watchdog` (timeouts and aborts), `support` (CuPy-free: library discovery, dtypes,
unique-id exchange). Importing it imports no CuPy; the registry finds `BACKEND` here."""

from axond.distributed.backends.nccl.backend import NcclBackend

BACKEND = NcclBackend

__all__ = ["BACKEND", "NcclBackend"]
