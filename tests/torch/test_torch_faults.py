"""Failures never crash: torch DDP and FSDP2 over "axond" with rank 1 raising, exiting or killed at each point of a
training step (the matrix is tests/helpers/torch_fault_cases.py). The survivor must raise `axond.DistributedError` (a
`RuntimeError` for torch code) that names rank 1, and for a raise rank 1's exception; no rank may die of a signal
it was not sent, and nothing may wait for the group's timeout.

One process runs the whole matrix (torch is imported once; each case forks its two ranks), ~1-2 s a case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch_fault_cases as cases

HERE = Path(__file__).resolve().parents[1] / "helpers"
# the first test waits for the module's runner
# slow: the fault matrix: 21 cases of forked torch ranks
pytestmark = [pytest.mark.slow, pytest.mark.timeout(len(cases.CASES) * cases.CASE_DEADLINE + 120)]

@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("faults") / "results.json"
    budget = len(cases.CASES) * cases.CASE_DEADLINE + 60
    p = subprocess.run([sys.executable, str(HERE / "torch_fault_cases.py"), "--out", str(out)], cwd=HERE,
                       capture_output=True, text=True, timeout=budget, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, f"the matrix runner failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def expected_code(how: str) -> int:
    return {"raise": 1, "exit": 3, "kill": -9}[how]


@pytest.mark.parametrize("case", cases.CASES)
def test_survivor_raises_the_root_cause(matrix: dict[str, Any], case: str) -> None:
    got = matrix[case]
    how = case.split("-")[2]
    logs = f"rank 0:\n{got['logs'][0]}\nrank 1:\n{got['logs'][1]}"
    assert not got["killed"], f"{case}: ranks {got['killed']} still ran after {cases.CASE_DEADLINE} s\n{logs}"
    assert got["codes"] == [0, expected_code(how)], f"{case}: exit codes {got['codes']}\n{logs}"
    report = got["reports"][0]
    assert report and "caught" in report, f"{case}: the survivor raised nothing: {report}\n{logs}"
    raised = report["caught"]["raised"][0]
    message = raised["message"]
    assert "DistributedError" in raised["mro"] and "RuntimeError" in raised["mro"], (
        f"{case}: the survivor raised {raised['type']} ({raised['mro']}): {message}")
    assert "rank 1" in message, f"{case}: the survivor's error does not name rank 1: {message}"
    if how == "raise":
        assert "ValueError" in message and cases.MESSAGE in message, (
            f"{case}: the survivor's error does not carry rank 1's exception: {message}")
