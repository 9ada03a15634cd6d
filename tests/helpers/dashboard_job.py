"""A running job for the dashboard tests: a token-protected coordinator with a metrics port, and one worker whose
two ranks hang in a way the dashboard must show (rank 0 blocked in an all_reduce, rank 1 in its own code)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from axond.coordinator.server import RunningCoordinator
from worker_support import FAST, Procs, wait_for

TOKEN = "dashboard-test-token"

HUNG = """
import os, pathlib, time, numpy as np, axond
axond.init_process_group(timeout=30.0)
pathlib.Path(os.environ["MARK_DIR"], os.environ["RANK"]).touch()
if axond.get_rank() == 1:
    time.sleep(120)
axond.all_reduce(np.ones(4))
"""


@dataclass
class DashboardJob:
    coord: RunningCoordinator
    url: str
    """The dashboard's address (without the token)."""


def start_dashboard_job(coordinator_factory: Callable[..., RunningCoordinator], procs: Procs, tmp_path: Path,
                        job: str = "shown") -> DashboardJob:
    coord = coordinator_factory(**FAST, metrics_port=0, token=TOKEN)
    assert coord.metrics is not None
    procs.axond("worker", "--coordinator", coord.address, "--token", TOKEN, "--job", job, "--nproc-per-node", "2",
                "--stop-grace", "1", "--", sys.executable, "-c", HUNG, env={"MARK_DIR": str(tmp_path)})
    wait_for(lambda: (tmp_path / "0").exists() and (tmp_path / "1").exists(), 90, "both ranks to start")
    return DashboardJob(coord, f"http://127.0.0.1:{coord.metrics.port}/")
