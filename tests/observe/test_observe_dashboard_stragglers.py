"""The coordinator's dashboard data names the straggler of a running job (as `axond status --job` does)."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from axond.coordinator.server import RunningCoordinator
from worker_support import FAST, Procs, procs, wait_for  # noqa: F401


@pytest.mark.slow  # four ranks training until the straggler is seen
@pytest.mark.timeout(150)
def test_the_dashboard_names_the_straggler(coordinator_factory: Callable[..., RunningCoordinator],
                                           procs: Procs) -> None:
    coord = coordinator_factory(**FAST, metrics_port=0, insecure=True)
    assert coord.metrics is not None
    # the windows and thresholds at their defaults, as the coordinator reads them
    env = {"SLOW_RANK": "1", "SLOW_S": "0.2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs.axond("worker", "--coordinator", coord.address, "--job", "slow", "--nproc-per-node", "4",
                "--", sys.executable, "-m", "axond.testing.straggler_job", "400", env=env)
    url = f"http://127.0.0.1:{coord.metrics.port}/api/state"
    ranks: list[dict[str, Any]] = []

    def named() -> bool:
        with urllib.request.urlopen(url, timeout=10) as r:
            jobs = {j["job"]: j for j in json.loads(r.read())["jobs"]}
        ranks[:] = jobs.get("slow", {}).get("ranks", [])
        return any(r["straggler"] for r in ranks)

    wait_for(named, 90, "a straggler on the dashboard", 0.5)
    flagged = {r["rank"]: r["straggler"] for r in ranks if r["straggler"]}
    assert list(flagged) == [1], ranks
    assert re.fullmatch(r"yes: others wait \d+ ms in [\d.]+ s \(\d+%\)", flagged[1]), flagged
