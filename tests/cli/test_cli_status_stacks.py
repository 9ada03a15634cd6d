"""`axond status --job J --stacks`: every rank's Python stacks (every thread) and what it is blocked in, asked at
any moment of the workers on every node, through the coordinator; a stopped rank is named as stopped; a torch job's
Flight Recorder dumps gathered with `--fr-dir` load in torch's analyzer, which names the rank that did not join."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from axond.coordinator.server import RunningCoordinator
from worker_support import Procs, coord, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = """
import threading, time, numpy as np, axond
axond.init_process_group(timeout=60.0)

def stuck_in_user_code():
    time.sleep(120)

def side_thread_loop():
    time.sleep(120)

if axond.get_rank() == 0:
    threading.Thread(target=side_thread_loop, name="side", daemon=True).start()
    stuck_in_user_code()
axond.all_reduce(np.ones(3))
"""


def _section(text: str, rank: int) -> str:
    """The lines of `rank`'s part of the STACKS table."""
    found = re.search(rf"^rank {rank} .*?(?=^rank \d|\Z)", text, re.M | re.S)
    return found.group(0) if found else ""


@pytest.mark.slow  # two worker daemons and a two-node job
@pytest.mark.timeout(120)
def test_stacks_of_every_rank_on_every_node(coord: RunningCoordinator, procs: Procs) -> None:
    for _ in range(2):
        procs.axond("worker", "--coordinator", coord.address, "--slots", "1")
    procs.axond("run", "--coordinator", coord.address, "--nnodes", "2", "--nproc-per-node", "1", "--job", "hung",
                "--", PY, "-c", SCRIPT)
    seen: list[str] = []

    def both_answered() -> bool:
        res = procs.run("status", "--coordinator", coord.address, "--job", "hung", "--stacks", "--stacks-wait", "3")
        seen.append(res.stdout + res.stderr)
        return (res.code == 0 and "stuck_in_user_code" in _section(res.stdout, 0)
                and "all_reduce" in _section(res.stdout, 1))

    wait_for(both_answered, 60, "both ranks' stacks, from the two workers", 0.5)
    zero, one = _section(seen[-1], 0), _section(seen[-1], 1)
    assert "in no collective for long" in zero and "side_thread_loop" in zero, zero  # every thread
    assert zero.count("Thread 0x") + zero.count("Current thread 0x") >= 2, zero
    assert re.search(r"pid \d+\): ", one) and "stuck_in_user_code" not in one, one
    pid = int(re.search(r"^rank 0 \(.*?, pid (\d+)\)", zero, re.M).group(1))  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        res = procs.run("status", "--coordinator", coord.address, "--job", "hung", "--stacks", "--stacks-wait", "5")
        assert "stopped (state T" in _section(res.stdout, 0), res.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone if the worker already ended the job
            os.kill(pid, signal.SIGCONT)


def test_stacks_need_a_job_and_dumps_need_stacks(procs: Procs) -> None:
    res = procs.run("status", "--stacks")
    assert res.code == 2 and "--stacks needs --job" in res.stderr, res.stderr
    res = procs.run("status", "--job", "j", "--fr-dir", "x")
    assert res.code == 2 and "--fr-dir needs --stacks" in res.stderr, res.stderr


TORCH_SCRIPT = """
import time, torch, torch.distributed as dist
import axond.torch
dist.init_process_group("axond")
dist.all_reduce(torch.ones(3))  # every rank: collective 1 of the group
if dist.get_rank() == 1:
    time.sleep(120)  # stuck in its own code: never joins collective 2
dist.all_reduce(torch.ones(3))
"""


@pytest.mark.slow  # two worker daemons and a two-node torch job
@pytest.mark.timeout(150)
def test_a_torch_jobs_dumps_load_in_the_flight_recorder_analyzer(coord: RunningCoordinator, procs: Procs,
                                                                  tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    for _ in range(2):
        procs.axond("worker", "--coordinator", coord.address, "--slots", "1")
    procs.axond("run", "--coordinator", coord.address, "--nnodes", "2", "--nproc-per-node", "1", "--job", "hung",
                "--", PY, "-c", TORCH_SCRIPT)
    dumps = tmp_path / "fr"

    def both_dumped() -> bool:
        res = procs.run("status", "--coordinator", coord.address, "--job", "hung", "--stacks", "--stacks-wait", "5",
                        "--fr-dir", str(dumps))
        return res.code == 0 and "FLIGHT RECORDER: the dumps of ranks [0, 1]" in res.stdout and \
            "all_reduce" in _section(res.stdout, 0)

    wait_for(both_dumped, 90, "both ranks' Flight Recorder dumps", 0.5)
    res = subprocess.run([PY, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)], capture_output=True,
                         text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Not all ranks joining collective, sequence number: 2" in out, out
    assert "missing ranks: {1}" in out and "collective: gloo:all_reduce" in out, out


TORCH_STOPPED = """
import datetime, os, pathlib, signal, torch, torch.distributed as dist
import axond.torch
dist.init_process_group("axond", timeout=datetime.timedelta(seconds=24))
dist.all_reduce(torch.ones(3))  # every rank: collective 1 of the group
if dist.get_rank() == 1:
    pathlib.Path(os.environ["MARK_DIR"], "stopped").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped: never joins collective 2, and cannot dump
dist.all_reduce(torch.ones(3))
"""


@pytest.mark.slow  # a worker daemon and a two-rank torch job
@pytest.mark.timeout(150)
def test_a_hang_writes_the_dumps_by_itself_into_axond_fr_dump_dir(coord: RunningCoordinator, procs: Procs,
                                                                   tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    script, dumps = tmp_path / "train.py", tmp_path / "fr"
    script.write_text(TORCH_STOPPED)
    worker = procs.axond("worker", "--coordinator", coord.address, "--job", "stopped", "--nproc-per-node", "2",
                         "--stop-grace", "1", "--", PY, str(script),
                         env={"MARK_DIR": str(tmp_path), "AXOND_WAIT_NOTICE_S": "2", "AXOND_FR_DUMP_DIR": str(dumps)})
    lines: list[str] = []
    stream = worker.stderr
    assert stream is not None
    threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True).start()
    mark = tmp_path / "stopped"
    wait_for(mark.exists, 90, "rank 1 to stop itself")
    pid = int(mark.read_text())
    try:
        # rank 0 reports its all_reduce after a quarter of the 24 s timeout (6 s) and dumps then: no `axond status`
        try:
            wait_for((dumps / "axond_fr_rank_0").exists, 60, "rank 0's dump, written on the hang by itself")
        except pytest.fail.Exception:
            pytest.fail("no dump of rank 0 in 60 s; the worker said:\n" + "".join(lines))
        assert sorted(p.name for p in dumps.iterdir()) == ["axond_fr_rank_0"]  # the stopped rank writes none
        written, notices = (dumps / "axond_fr_rank_0").stat().st_mtime_ns, sum("still waiting" in x for x in lines)
        wait_for(lambda: sum("still waiting" in x for x in lines) >= notices + 2, 30, "two more notices")
        assert (dumps / "axond_fr_rank_0").stat().st_mtime_ns == written  # once per hang, not per notice
        told = [x for x in lines if "still waiting" in x and f"Flight Recorder dumps to {dumps}" in x]
        assert told, "the worker's notices say where the dumps are:\n" + "".join(lines)
        res = subprocess.run([PY, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "Missing dump files from ranks {1}" in res.stdout + res.stderr, res
        res = subprocess.run([PY, "-m", "torch.distributed.flight_recorder.fr_trace", "--allow-incomplete-ranks",
                              str(dumps)], capture_output=True, text=True, timeout=60)
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "we missed FR dumps from ranks ({1})" in out, out
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone if the worker already ended the job
            os.kill(pid, signal.SIGCONT)
