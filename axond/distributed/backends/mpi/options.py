"""The mpi backend's own settings: `MpiOptions`, read from AXOND_MPI_* unless given in `BackendOptions(mpi=...)`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from axond.env_flags import parse_flag

CHECK_ENV = "AXOND_MPI_CHECK_CALLS"
SPIN_ENV = "AXOND_MPI_SPIN"
SPIN = 1 << 62
"""Polls before yielding, where every rank of the host has a core of its own: never, as MPI's own blocking calls (a
yield on a busy host gives the core away for milliseconds: docs/mpi.md#settings)."""


@dataclass(frozen=True)
class MpiOptions:
    """How the mpi backend runs its ops."""

    check_calls: bool = True
    """With each collective, check that every member called the same op, dtype, size and root (an all_gather of an
    8-byte digest of each member's call; a mismatch raises on every rank, naming the peer). Off
    (AXOND_MPI_CHECK_CALLS=0): a mismatch is whatever the MPI library does with it (an MPI error, a timeout, or wrong
    data)."""
    spin: int | None = None
    """Polls of a request before each further poll also yields the core to other processes (AXOND_MPI_SPIN); None:
    `SPIN` (never yield), or 0 where this host's ranks outnumber its cores (a peer that must progress may be waiting
    for one: as Open MPI's mpi_yield_when_idle)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> MpiOptions:
        """The options AXOND_MPI_CHECK_CALLS and AXOND_MPI_SPIN of `environ` set."""
        check = parse_flag(CHECK_ENV, environ.get(CHECK_ENV) or "1")
        raw = environ.get(SPIN_ENV, "").strip()
        try:
            spin = int(raw) if raw else None
        except ValueError:
            spin = -1
        if spin is not None and spin < 0:
            raise ValueError(f"bad {SPIN_ENV}={raw!r}: use an integer >= 0 (polls before yielding the core)")
        return cls(check_calls=check, spin=spin)

    def for_new_group(self) -> MpiOptions:
        """The same options: none belongs to the default group alone."""
        return self
