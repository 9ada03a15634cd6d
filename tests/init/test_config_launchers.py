"""Ranks from MPI launchers' variables (`axond.launchers`), read into `RuntimeEnv` where RANK and the rest are unset."""

from __future__ import annotations

import pytest

from axond.config import ConfigError, RuntimeEnv
from axond.launchers import LauncherError, launcher_ranks, tasks_per_node

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
SRUN = {"PMIX_RANK": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,2(x1)",
        "SLURM_NODEID": "1"}


@pytest.mark.parametrize("environ,launcher,ranks", [
    (OMPI, "Open MPI (mpirun)", (3, 4, 1, 2)),
    (MPICH, "MPICH/PMI (mpiexec)", (2, 3, 0, 1)),
    (SRUN, "PMIx (srun --mpi=pmix)", (5, 6, 1, 2)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPICH/PMI (mpiexec)", (0, 2, None, None)),
])
def test_each_launcher_s_variables_give_the_ranks(environ: dict[str, str], launcher: str,
                                                  ranks: tuple[int, int, int | None, int | None]) -> None:
    env = RuntimeEnv.from_env(environ)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == ranks
    assert env.launcher == launcher


def test_torchrun_s_names_win_and_nothing_is_found_without_a_launcher() -> None:
    env = RuntimeEnv.from_env({**OMPI, "RANK": "0", "WORLD_SIZE": "4"})
    assert (env.rank, env.world_size, env.local_rank) == (0, 4, 1)
    plain = RuntimeEnv.from_env({})
    assert plain.launcher is None and plain.rank is None
    assert launcher_ranks({"OMPI_COMM_WORLD_RANK": "", "PMI_RANK": " "}) is None


def test_open_mpi_wins_over_pmix_as_open_mpi_5_sets_both() -> None:
    env = RuntimeEnv.from_env({**OMPI, "PMIX_RANK": "0"})
    assert env.launcher == "Open MPI (mpirun)" and env.rank == 3


def test_a_launcher_that_gives_too_little_is_named() -> None:
    with pytest.raises(ConfigError, match=r"PMIX_RANK is set \(PMIx \(srun --mpi=pmix\)\) but not the world size: "
                                          r"none of PMIX_SIZE, SLURM_NTASKS, SLURM_NPROCS is"):
        RuntimeEnv.from_env({"PMIX_RANK": "1"})
    with pytest.raises(ConfigError, match=r"bad OMPI_COMM_WORLD_SIZE='four'"):
        RuntimeEnv.from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "four"})
    with pytest.raises(ConfigError, match="PMI_RANK=3 is outside the world size 3"):
        RuntimeEnv.from_env({"PMI_RANK": "3", "PMI_SIZE": "3"})
    assert RuntimeEnv.from_env({"PMIX_RANK": "1"}, strict=False).rank is None  # `import axond` never raises


def test_slurm_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(LauncherError, match="SLURM_STEP_TASKS_PER_NODE='2x3'"):
        tasks_per_node("2x3")
    with pytest.raises(ConfigError, match="SLURM_NODEID=4 is past the 2 nodes"):
        RuntimeEnv.from_env({**SRUN, "SLURM_NODEID": "4"})
