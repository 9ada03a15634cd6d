"""Under real torchrun, its "Root Cause (first observed failure)" names the rank that failed first, not a survivor
that failed because of it and exited sooner (`FailureSettings.survivor_exit_delay_s`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

RAISE = """
import atexit, time, torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import axond.torch

@record
def main():
    dist.init_process_group("axond")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 2))
    for step in range(20):
        if dist.get_rank() == 1 and step == 3:
            atexit.register(time.sleep, 1.0)  # a slow teardown: the survivor would exit first
            raise ValueError("bad batch on rank 1")
        model(torch.randn(4, 10)).sum().backward()
main()
"""

LOOP = """
import os, pathlib, time, torch, torch.distributed as dist
import axond.torch
dist.init_process_group("axond")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 2))
pathlib.Path(os.environ["PID_DIR"], os.environ["RANK"]).write_text(str(os.getpid()))
while True:
    model(torch.randn(4, 10)).sum().backward()
    time.sleep(0.01)
"""


def _torchrun(script: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("AXOND_", "TORCHELASTIC_"))}
    full.update(env)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                            env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _root_cause(stderr: str) -> str:
    found = re.search(r"Root Cause \(first observed failure\):\n(.*?)\n={10,}", stderr, re.S)
    assert found is not None, stderr[-3000:]
    return found.group(1)


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"torchrun did not finish within 120 s:\n{err[-3000:]}")
    return err


@pytest.mark.slow
def test_torchrun_names_the_rank_that_raised_not_the_survivor(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RAISE)
    cause = _root_cause(_finish(_torchrun(script, {})))
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", cause), cause
    assert "ValueError: bad batch on rank 1" in cause, cause


@pytest.mark.slow
def test_torchrun_names_the_sigkilled_rank_and_its_signal(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LOOP)
    proc = _torchrun(script, {"PID_DIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(int((tmp_path / "1").read_text()), signal.SIGKILL)
    finally:
        cause = _root_cause(_finish(proc))
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", cause), cause
    assert "SIGKILL" in cause, cause
