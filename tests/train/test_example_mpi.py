"""`mpirun -n 4 python -m axond.examples.train_mlp` trains without any axond daemon, over the mpi backend and over
tcp formed through MPI, to the parameters the same run has under `axond worker`. Skipped without Open MPI/mpi4py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from axond.nn.utils import load_checkpoint
from mpi_launch import RENDEZVOUS, mpirun, mpirun_or_skip

ARGS = ["-m", "axond.examples.train_mlp", "--epochs", "2", "--samples", "1024", "--hidden", "32"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_mlp_under_mpirun_matches_the_worker(tmp_path: Path) -> None:
    mpirun_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    worker = subprocess.run(
        [sys.executable, "-c", "from axond.cli.main import main; main()", "worker", "--standalone",
         "--nproc-per-node", "4", "--", sys.executable, *ARGS, "--backend", "tcp", "--checkpoint",
         str(tmp_path / "worker.npz")], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert worker.returncode == 0, worker.stderr[-4000:]
    reference = load_checkpoint(tmp_path / "worker.npz")
    for backend in ("mpi", "tcp"):
        path = tmp_path / f"{backend}.npz"
        proc = mpirun(4, [*ARGS, "--backend", backend, "--checkpoint", str(path)], timeout=300)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        assert f"training on 4 rank(s), backend {backend}" in proc.stdout, proc.stdout
        got = load_checkpoint(path)
        assert sorted(got) == sorted(reference)
        for name, value in reference.items():
            # the same seeded data and steps; only the order of the 4-way float32 gradient sums differs between
            # MPI's algorithms and tcp's (a few ulps per step, through 2 epochs of AdamW): agreement to 1e-4.
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{backend}: {name}")
