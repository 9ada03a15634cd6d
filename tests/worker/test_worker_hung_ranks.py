"""A hung rank is reported while it hangs: torch DDP ranks over "axond" publish what they are blocked in like native
ones (`axond.distributed.diagnostics.job_report`), and the worker's notice comes when the op has waited the
configured interval (`worker/progress.py`), not up to an interval later."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from axond.coordinator.server import RunningCoordinator
from axond.worker.progress import EarlyExitWatch
from worker_support import Procs, coord, procs, wait_for  # noqa: F401

PY = sys.executable

TORCH_HANG = """
import datetime, os, pathlib, time, torch, torch.distributed as dist
import axond.torch
dist.init_process_group("axond", timeout=datetime.timedelta(seconds=24))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 2))
pathlib.Path(os.environ["MARK_DIR"], os.environ["RANK"]).touch()
if dist.get_rank() == 1:
    time.sleep(120)  # hung in its own code: rank 0 waits in DDP's all_reduce
model(torch.randn(4, 10)).sum().backward()
"""


@pytest.mark.slow
def test_a_hung_torch_ddp_rank_is_reported_by_the_worker_and_status(coord: RunningCoordinator, procs: Procs,
                                                                    tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(TORCH_HANG)
    worker = procs.axond("worker", "--coordinator", coord.address, "--job", "hung-torch", "--nproc-per-node", "2",
                         "--stop-grace", "1", "--", PY, str(script),
                         env={"MARK_DIR": str(tmp_path), "AXOND_WAIT_NOTICE_S": "2"})
    lines: list[str] = []
    assert worker.stderr is not None
    stream = worker.stderr
    threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True).start()
    said = re.compile(r"still waiting: rank 0 blocked in all_reduce on group 'torch:0' for [\d.]+ s; "
                      r"rank\(s\) 1 report no blocked op")
    # reports start after a quarter of the 24 s timeout (6 s); the notice follows within the 2 s interval
    wait_for(lambda: any(said.search(line) for line in lines), 60, "the worker's notice naming rank 0's wait")
    res = procs.run("status", "--coordinator", coord.address, "--job", "hung-torch")
    assert res.code == 0, res.stderr
    assert re.search(r"^hung-torch\s+0\s+.*all_reduce on group 'torch:0' for \d+\.\d s$", res.stdout, re.M), res.stdout
    assert re.search(r"^hung-torch\s+1\s+.*\s-$", res.stdout, re.M), res.stdout


class _Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_notice_comes_when_the_op_has_waited_the_interval() -> None:
    """An op that starts after the watch's first read is reported once it has waited `every`, not at the next
    multiple of `every` after the watch started (which made a 60 s notice come at ~120 s)."""
    clock, every = _Clock(), 60.0
    op_since = clock.now + 7.0  # the op begins 7 s into the generation; its report appears 10 s later
    notices: list[tuple[float, str]] = []
    reads: list[float] = []

    def blocked(ranks: object) -> dict[int, list[tuple[str, str, float]]]:
        reads.append(clock.now)
        published = clock.now >= op_since + 10.0
        return {0: [("world", "all_reduce", op_since)] if published else [], 1: []}

    watch = EarlyExitWatch("j", lambda text: notices.append((clock.now, text)), every=every, blocked=blocked,
                           clock=clock, fr_dump_dir="/tmp/fr")
    while clock.now < op_since + 3 * every and len(notices) < 2:
        watch.check((), [0, 1])
        clock.now += 0.05
    first_at, text = notices[0]
    assert every <= first_at - op_since < every + 0.2, (first_at - op_since, text)
    assert "rank 0 blocked in all_reduce on group 'world' for 60.0 s" in text, text
    assert "write their Flight Recorder dumps to /tmp/fr (read them with `python -m torch.distributed.flight_recorder" \
           ".fr_trace --allow-incomplete-ranks /tmp/fr`)" in text, "the notice says where AXOND_FR_DUMP_DIR put them"
    assert notices[1][0] - first_at == pytest.approx(every, abs=0.2), "then one notice per interval"
    assert len(reads) <= 3 * every / (every / 4) + 3, "the store is read every quarter interval, not every tick"


HUNG_NATIVE = """
import os, pathlib, time, numpy as np, axond
axond.init_process_group(timeout=24.0)
pathlib.Path(os.environ["MARK_DIR"], os.environ["RANK"]).write_text(str(os.getpid()))
def stuck_in_user_code():
    time.sleep(120)
if axond.get_rank() == 1 and os.environ.get("STOP_ME") != "1":
    stuck_in_user_code()
if axond.get_rank() == 1:
    time.sleep(1.0)  # the test SIGSTOPs it here, before the collective
axond.all_reduce(np.ones(4))
"""


def _pid_of(mark: Path) -> int:
    """The pid the rank writes into `mark` (the file exists before its text is written: wait for the text)."""
    wait_for(lambda: mark.exists() and mark.read_text().strip() != "", 90, "rank 1 to start")
    return int(mark.read_text())


def _hang(coord: RunningCoordinator, procs: Procs, tmp_path: Path, job: str, stop: bool) -> list[str]:
    """Run HUNG_NATIVE (rank 1 hung in Python code, or SIGSTOPped) until the worker named rank 1's state."""
    worker = procs.axond("worker", "--coordinator", coord.address, "--job", job, "--nproc-per-node", "2",
                         "--stop-grace", "1", "--", PY, "-c", HUNG_NATIVE,
                         env={"MARK_DIR": str(tmp_path), "AXOND_WAIT_NOTICE_S": "2", "STOP_ME": "1" if stop else "0"})
    lines: list[str] = []
    assert worker.stderr is not None
    stream = worker.stderr
    threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True).start()
    pid = _pid_of(tmp_path / "1")
    if stop:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: any("rank 1, which the others wait for" in line for line in lines), 60,
                 "the worker's notice about rank 1 (reports start after 6 s of the 24 s timeout)")
        time.sleep(0.5)  # the stacks' lines follow the notice's first line
    finally:
        if stop:
            os.kill(pid, signal.SIGCONT)
    return lines


@pytest.mark.slow
def test_a_rank_hung_in_python_is_named_with_its_stacks(coord: RunningCoordinator, procs: Procs,
                                                        tmp_path: Path) -> None:
    text = "".join(_hang(coord, procs, tmp_path, "stacks", stop=False))
    assert "still waiting: rank 0 blocked in all_reduce on group 'world'" in text, text
    assert re.search(r"rank 1, which the others wait for: pid \d+, its Python stacks \(every thread\):", text), text
    assert "in stuck_in_user_code" in text and "Current thread" in text, text


@pytest.mark.slow
def test_a_stopped_rank_is_named_as_stopped(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    text = "".join(_hang(coord, procs, tmp_path, "stopped", stop=True))
    assert re.search(r"rank 1, which the others wait for: pid (\d+), stopped \(state T in /proc/\1/stat\)", text), text


TIMES_OUT = """
import os, pathlib, time, numpy as np, axond
axond.init_process_group(timeout=6.0)
pathlib.Path(os.environ["MARK_DIR"], os.environ["RANK"]).write_text(str(os.getpid()))
if axond.get_rank() == 1:
    time.sleep(1.0)  # the test SIGSTOPs it here, before the collective
axond.all_reduce(np.ones(4))
"""


@pytest.mark.slow
def test_at_the_group_timeout_the_stopped_rank_is_named_before_it_is_stopped(coord: RunningCoordinator, procs: Procs,
                                                                            tmp_path: Path) -> None:
    worker = procs.axond("worker", "--coordinator", coord.address, "--job", "timeout", "--nproc-per-node", "2",
                         "--stop-grace", "1", "--", PY, "-c", TIMES_OUT, env={"MARK_DIR": str(tmp_path)})
    pid = _pid_of(tmp_path / "1")
    os.kill(pid, signal.SIGSTOP)
    try:
        done = procs.finish(worker, timeout=90)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    lines = done.stderr.splitlines()
    told = [i for i, line in enumerate(lines) if re.search(
        rf"rank 1, which rank\(s\) 0 failed waiting for: pid {pid}, stopped \(state T in /proc/{pid}/stat\)", line)]
    failed = [i for i, line in enumerate(lines) if "timed out after 6.0 s waiting for peer 1" in line
              and line.startswith("axond worker: rank 0")]
    assert told and failed and told[0] < failed[0], done.stderr[-3000:]
