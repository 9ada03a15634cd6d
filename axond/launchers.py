"""The ranks an MPI launcher hands a process (`mpirun`, `mpiexec`, `srun --mpi=pmix`), from the variables it sets.

`axond.config.RuntimeEnv.from_env` calls `launcher_ranks` on the environment it read, so that RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's names, what `axond worker` sets) fall back to the launcher's: Open MPI's
OMPI_COMM_WORLD_*, MPICH's and Intel MPI's PMI_RANK/PMI_SIZE and MPI_LOCALRANKID/MPI_LOCALNRANKS, PMIx's PMIX_RANK
with Slurm's task counts (`srun --mpi=pmix`). This module reads only the mapping it is given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LAUNCHERS", "OPEN_MPI_DEFAULTS", "Launcher", "LauncherError", "LauncherRanks", "launcher_ranks",
           "tasks_per_node"]


class LauncherError(ValueError):
    """A launcher set some of its variables but not the ones axond needs; the message names them."""


@dataclass(frozen=True)
class Launcher:
    """The variables one family of MPI launchers sets (None: it sets none for that value)."""

    name: str
    """How docs and errors call it."""
    rank: str
    """The global rank's variable: its presence says this launcher started the process."""
    size: tuple[str, ...]
    """The world size's variables, the first one set wins."""
    local_rank: tuple[str, ...]
    """The rank on this node."""
    local_size: tuple[str, ...]
    """The ranks on this node."""


LAUNCHERS = (
    Launcher("Open MPI (mpirun)", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
             ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    Launcher("MPICH/PMI (mpiexec)", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    Launcher("PMIx (srun --mpi=pmix)", "PMIX_RANK", ("PMIX_SIZE", "SLURM_NTASKS", "SLURM_NPROCS"),
             ("PMIX_LOCAL_RANK", "SLURM_LOCALID"), ("PMIX_LOCAL_SIZE",)),
)
"""Launcher families in the order they are looked for (Open MPI 5 sets both OMPI_* and PMIX_*: OMPI_* wins)."""


OPEN_MPI_DEFAULTS = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}
"""Open MPI settings MPI starts with where the job sets none (`config.export_defaults`): the ring for the nonblocking
all_reduce the mpi backend runs on (libnbc's own choice is several times slower on two ranks: docs/mpi.md#settings)."""


@dataclass(frozen=True)
class LauncherRanks:
    """What a launcher said about this process."""

    launcher: str
    """Which launcher (`Launcher.name`)."""
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None


def _int(environ: Mapping[str, str], var: str) -> int:
    raw = environ[var].strip()
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise LauncherError(f"bad {var}={raw!r}: use an integer >= 0 (the MPI launcher sets it)")
    return value


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for var in names:
        if environ.get(var, "").strip():
            return _int(environ, var)
    return None


_BLOCK = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's SLURM_STEP_TASKS_PER_NODE ("2(x3),1") as one count per node ([2, 2, 2, 1]); LauncherError if not."""
    counts: list[int] = []
    for block in spec.strip().split(","):
        m = _BLOCK.match(block.strip())
        if m is None:
            raise LauncherError(f"bad SLURM_STEP_TASKS_PER_NODE={spec!r}: expected counts like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_local_size(environ: Mapping[str, str]) -> int | None:
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    node = environ.get("SLURM_NODEID", "").strip()
    if not spec or not node:
        return None
    counts = tasks_per_node(spec)
    index = _int(environ, "SLURM_NODEID")
    if index >= len(counts):
        raise LauncherError(f"SLURM_NODEID={index} is past the {len(counts)} nodes of "
                            f"SLURM_STEP_TASKS_PER_NODE={spec!r}")
    return counts[index]


def launcher_ranks(environ: Mapping[str, str]) -> LauncherRanks | None:
    """The ranks the MPI launcher that started this process set in `environ`, or None where no launcher did.

    Raises `LauncherError` naming what is missing when a launcher set the rank but not the world size, or a value
    that is not a count.
    """
    for launcher in LAUNCHERS:
        if not environ.get(launcher.rank, "").strip():
            continue
        rank = _int(environ, launcher.rank)
        size = _first(environ, launcher.size)
        if size is None:
            raise LauncherError(f"{launcher.rank} is set ({launcher.name}) but not the world size: none of "
                                f"{', '.join(launcher.size)} is; set WORLD_SIZE (and RANK) yourself, or launch "
                                "with a launcher that sets them")
        if not rank < size:
            raise LauncherError(f"{launcher.rank}={rank} is outside the world size {size} ({launcher.name})")
        local_size = _first(environ, launcher.local_size)
        if local_size is None and launcher.rank == "PMIX_RANK":
            local_size = _slurm_local_size(environ)
        return LauncherRanks(launcher.name, rank, size, _first(environ, launcher.local_rank), local_size)
    return None
