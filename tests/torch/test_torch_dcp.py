"""torch.distributed.checkpoint on "axond": `dcp.async_save` of an FSDP2 model and its reload, and a full state dict
broadcast from rank 0 into an FSDP2 model (tests/helpers/torch_dcp_cases.py; `--backend gloo` runs the same on gloo).
Both need the "axond" group to report its device types as torch's own backends do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch_dcp_cases as cases

HERE = Path(__file__).resolve().parents[1] / "helpers"
# the first test waits for the module's runner
# slow: torch.distributed.checkpoint on forked torch ranks
pytestmark = [pytest.mark.slow, pytest.mark.timeout(len(cases.CASES) * cases.CASE_DEADLINE + 120)]

@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dcp") / "results.json"
    p = subprocess.run([sys.executable, str(HERE / "torch_dcp_cases.py"), "--out", str(out)], cwd=HERE,
                       capture_output=True, text=True, timeout=len(cases.CASES) * cases.CASE_DEADLINE + 60,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, f"the DCP runner failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", cases.CASES)
def test_dcp_on_axond(results: dict[str, Any], case: str) -> None:
    got = results[case]
    for rank, report in enumerate(got["reports"]):
        where = f"{case}, rank {rank} (exit code {got['codes'][rank]})"
        assert report is not None, f"{where}: no report\n{got['logs'][rank]}"
        if "raised" in report:
            pytest.fail(f"{where} raised {report['raised']['raised'][0]['type']}: "
                        f"{report['raised']['raised'][0]['message']}\n{report['raised']['traceback']}")
        assert report["ok"], f"{where}: these entries differ from what was saved or broadcast: {report['differ']}"
    assert got["codes"] == [0, 0], got["codes"]
