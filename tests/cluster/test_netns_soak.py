"""A short chaos soak (bench/soak.py): four network-namespace hosts of one rank each, `axond worker --live-recovery
--nnodes 2:4 --max-restarts 1000`, `DistributedTrainer` (ddp); one fault of each kind on a random host, one every 12 s:
its rank SIGKILLed, its rank SIGSTOPped for 5 s (its worker kills it at the lease), its link dropping every frame both
ways for 5 s (its worker loses its lease and stops its rank, then re-joins once the link is back). After each fault
the failed node's own worker re-joins as a replacement and the job is back at four ranks; no wait between committed
steps exceeds what the lease, the fence and a re-formation allow; every step's parameters on every rank equal a
fault-free replay of the same four virtual ranks; no step is lost or applied twice.

Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from axond.testing.netns import unavailable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from soak_report import analyse
from soak_run import FULL, SoakConfig, run_soak

pytestmark = pytest.mark.slow  # a live job across five network-namespace hosts, three faults


@pytest.mark.timeout(420)
def test_one_fault_of_each_kind_no_hang_no_divergence_back_at_full_size(tmp_path: Path) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    config = SoakConfig(duration=36.0, period=12.0, cycle=True, hold=5.0, hidden=256, tail=60.0, log=False)
    run = run_soak(config, tmp_path / "soak")
    report = analyse(run)
    logs = {i: (run.out / f"worker{i}.log").read_text(errors="replace") for i in range(1, FULL + 1)}
    assert [f.kind for f in run.faults] == ["kill", "stop", "drop"], logs
    assert all(f.world == FULL for f in run.faults), run.faults  # each fault struck the job at full size
    assert report.hangs == [], (report.hangs, report.bound)
    assert report.divergences == [] and report.order_errors == [], (report.divergences[:5], report.order_errors)
    for outcome in report.outcomes:  # the job went on, and came back to four ranks
        assert outcome.first_step is not None and outcome.full_size is not None, (outcome, logs[outcome.fault.host])
        assert "re-joining it as a replacement" in logs[outcome.fault.host], logs[outcome.fault.host][-3000:]
    assert run.respawned == [], run.respawned  # every failed node's own worker re-joined (the cut one too)
    assert run.exit_codes == [0] * FULL, logs
    assert report.steps >= run.stop_step
