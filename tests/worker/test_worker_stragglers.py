"""The worker names the local rank the job waits for (`axond.worker.stragglers`): a notice, the end of it, a metric;
and under `axond worker --standalone`, a rank that computes 200 ms longer per step is named within 20 steps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from axond.config import StragglerSettings
from axond.observe.exposition import render
from axond.observe.worker_metrics import worker_families
from axond.worker.stragglers import StragglerWatch
from worker_support import Procs, procs  # noqa: F401

PY = sys.executable


def _report(waits: list[float], ops: int = 18) -> dict[str, Any]:
    marks, ns, t = [[0, 0, 0]], 0, 0
    for k, wait in enumerate(waits, start=1):
        ns, t = ns + int(wait * 1e9), t + int(1e9)
        marks.append([k, ns, t])
    return {"world": {"ranks": [0, 1, 2], "ops": ops, "w": marks}}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_local_straggler_is_told_once_counted_and_cleared(tmp_path: Path) -> None:
    notices: list[str] = []
    reports: dict[int, dict[str, Any]] = {}
    clock = Clock()
    watch = StragglerWatch("j", notices.append, lambda ranks: {r: reports[r] for r in ranks if r in reports}, 3,
                           [1, 2], StragglerSettings(window_ops=18, windows=3), str(tmp_path), every=1.0, clock=clock)
    slow = [0.3, 0.3, 0.3, 0.3]
    reports.update({0: _report(slow), 1: _report(slow), 2: _report([0.0] * 4)})
    for _ in range(3):  # read again without new windows: told once, counted once
        clock.now += 1.0
        watch.check()
    assert notices == ["job 'j': rank 2 is a straggler: the other ranks of group 'world' waited 0.900 s more than it "
                       "in the last 3.000 s (30% of the time; 54 collectives, 3 windows): it arrives last (it computes "
                       "slower)"]
    assert watch.lost_s == {1: 0.0, 2: pytest.approx(0.9)} and set(watch.named) == {2}
    reports.update({0: _report(slow + [0.3]), 1: _report(slow + [0.3]), 2: _report([0.0] * 5)})
    clock.now += 1.0
    watch.check()
    assert watch.lost_s[2] == pytest.approx(1.2), "one more mark lost to it"
    text = render(worker_families(tmp_path))
    assert 'axond_straggler_seconds_total{job="j",rank="2"} 1.2' in text
    assert 'axond_straggler{job="j",rank="2"} 1' in text and 'axond_straggler{job="j",rank="1"} 0' in text
    reports.update({r: _report(slow + [0.3] * 4) for r in (0, 1)})
    reports[2] = _report([0.0] * 5 + [0.3] * 3)
    clock.now += 1.0
    watch.check()
    assert notices[-1] == "job 'j': rank 2 is no longer a straggler" and watch.named == {}
    assert 'axond_straggler{job="j",rank="2"} 0' in render(worker_families(tmp_path))


def test_ranks_of_other_nodes_are_left_to_their_worker() -> None:
    notices: list[str] = []
    reports = {0: _report([0.3] * 4), 1: _report([0.3] * 4), 2: _report([0.0] * 4)}
    clock = Clock()
    watch = StragglerWatch("j", notices.append, lambda ranks: reports, 3, [0, 1], StragglerSettings(windows=3),
                           every=1.0, clock=clock)
    clock.now = 2.0
    watch.check()
    assert notices == [] and watch.named == {}


@pytest.mark.slow  # four ranks training for 20 steps
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("slow", "torch"), [(2, False), (-1, False), (1, True)],
                         ids=["native-rank-2-slow", "native-none-slow", "torch-rank-1-slow"])
def test_a_rank_busy_200ms_per_backward_is_named_within_20_steps(procs: Procs, slow: int,
                                                                  torch: bool) -> None:
    if torch:
        pytest.importorskip("torch")
    env = {"SLOW_RANK": str(slow), "SLOW_S": "0.2", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    job = "axond.testing.straggler_torch_job" if torch else "axond.testing.straggler_job"
    res = procs.run("worker", "--standalone", "--nproc-per-node", "4", "--", PY, "-m", job, "20", env=env, timeout=120)
    assert res.code == 0, res.stderr
    assert "[rank 0] step 20" in res.stdout
    named = [line for line in res.stderr.splitlines() if "is a straggler" in line]
    if slow < 0:
        assert named == [], "no rank is slow: none is named"
    else:  # the notice comes while every rank runs: within the job's 20 steps
        assert len(named) == 1 and f"rank {slow} is a straggler" in named[0], res.stderr
