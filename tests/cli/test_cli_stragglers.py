"""`axond status --job` names the rank the others wait for, in a STRAGGLER column."""

from __future__ import annotations

import re
import sys

import pytest

from axond.coordinator.server import RunningCoordinator
from status_here import status_here
from worker_support import Procs, coord, procs, wait_for  # noqa: F401

PY = sys.executable


@pytest.mark.slow  # four ranks training until the straggler is seen
@pytest.mark.timeout(150)
def test_status_shows_the_straggler(coord: RunningCoordinator, procs: Procs) -> None:
    env = {"SLOW_RANK": "3", "SLOW_S": "0.2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs.axond("worker", "--coordinator", coord.address, "--job", "slow", "--nproc-per-node", "4",
                "--", PY, "-m", "axond.testing.straggler_job", "400", env=env)
    straggler = r"^slow\s+3\s+.*yes: others wait \d+ ms in [\d.]+ s"

    def named() -> bool:  # polled in this process; then the real command once (the job runs on for a minute)
        code, out = status_here("--coordinator", coord.address, "--job", "slow")
        return code == 0 and re.search(straggler, out, re.M) is not None

    wait_for(named, 60, "rank 3 named in the STRAGGLER column", 0.5)
    res = procs.run("status", "--coordinator", coord.address, "--job", "slow")
    assert res.code == 0 and re.search(straggler, res.stdout, re.M), res.stdout + res.stderr
    assert "STRAGGLER" in res.stdout
    assert not re.search(r"^slow\s+[012]\s+.*yes: others wait", res.stdout, re.M), res.stdout
