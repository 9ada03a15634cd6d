"""What bench/soak_report.py reads from a soak's step logs for each fault: each survivor's error and re-formation, the
first step of a later generation and its world size, which of the processes training when the fault struck kept going,
and whether a re-formation read a checkpoint. Written step logs, no processes (the soak itself:
tests/cluster/test_netns_soak.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from soak_report import analyse, table
from soak_run import Fault, SoakConfig, SoakRun

FAULT_AT = 100.0
"""time.monotonic() of the fault in the written logs."""


def step(n: int, world: int, gen: int, mono: float) -> dict[str, Any]:
    return {"kind": "step", "step": n, "world": world, "rank": 0, "gen": gen, "hash": f"h{n}", "mono": mono}


def recovery(error_at: float, checkpoint: str | None = None) -> dict[str, Any]:
    return {"kind": "recovery", "step": 6, "world_before": 4, "world_after": 3, "generation": 2, "reason": "left",
            "error_at": error_at, "reformed_at": error_at + 0.1, "rolled_forward": False, "from_copies": [],
            "replayed": [], "checkpoint": checkpoint, "from_daemon": []}


def write(out: Path, pid: int, lines: list[dict[str, Any]]) -> None:
    (out / f"steps-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def soak(tmp_path: Path, stopped_survivor: bool = False, checkpoint: str | None = None) -> SoakRun:
    """Four ranks (pids 11-14) in generation 1 for steps 1-5 (one a second, the last at 95 s); pid 14 struck at
    100 s; the others raise at 101.6-101.8 s and commit step 6 at world size 3 in generation 2 at 102.5 s (pid 13
    not, with `stopped_survivor`); a replacement (pid 15) joins at step 8, at four ranks in generation 3."""
    before = [step(n, 4, 1, 90.0 + n) for n in range(1, 6)]
    for i, pid in enumerate((11, 12, 13)):
        after = [step(6, 3, 2, 102.5), step(7, 3, 2, 103.0), step(8, 4, 3, 110.0)]
        write(tmp_path, pid, before + [recovery(101.6 + 0.1 * i, checkpoint)]
              + ([] if stopped_survivor and pid == 13 else after))
    write(tmp_path, 14, before)
    write(tmp_path, 15, [step(8, 4, 3, 110.0)])
    fault = Fault("stop", 4, FAULT_AT, pid=14, world=4, gen=1)
    return SoakRun(SoakConfig(faults=("stop",)), tmp_path, started=80.0, first_full=91.0, ended=111.0,
                   faults=[fault], exit_codes=[0, 0, 0, 0])


def test_each_survivors_error_the_first_step_at_three_ranks_and_the_same_pids(tmp_path: Path) -> None:
    run = soak(tmp_path)
    report = analyse(run, reference=[""] + [f"h{n}" for n in range(1, 9)])
    (outcome,) = report.outcomes
    assert [round(e, 6) for e in outcome.errors] == [1.6, 1.7, 1.8]
    assert [round(e, 6) for e in outcome.reformed] == [1.7, 1.8, 1.9]
    assert outcome.first_step == 2.5 and outcome.world_after == 3
    assert outcome.survivors == (11, 12, 13) and outcome.kept == (11, 12, 13)  # the struck pid 14 is no survivor
    assert outcome.full_size == 10.0
    assert report.divergences == [] and report.from_storage == 0
    text = table(report, run)
    assert "| stop | 4 (14) | 1.70 (1.60-1.80) | 1.80 (1.70-1.90) | 2.50 (3) | 3 of 3 |" in text, text
    assert "| re-formations that read a checkpoint from storage | 0 |" in text, text


def test_a_survivor_that_never_trained_again_and_a_checkpoint_read_are_counted(tmp_path: Path) -> None:
    run = soak(tmp_path, stopped_survivor=True, checkpoint="/ckpt/step-5")
    report = analyse(run, reference=[""] + [f"h{n}" for n in range(1, 9)])
    (outcome,) = report.outcomes
    assert outcome.survivors == (11, 12, 13) and outcome.kept == (11, 12)
    assert report.from_storage == 3
    assert "| 2 of 3 |" in table(report, run)
