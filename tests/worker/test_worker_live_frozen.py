"""Live recovery of a frozen rank: a real `axond coordinator`, three `axond worker --live-recovery` nodes, and a
DistributedTrainer whose rank 2 is SIGSTOPped mid-training (its worker keeps heartbeating, its sockets stay open).

The worker kills a rank stopped for longer than the node's lease (heartbeat interval x missed heartbeats), and the
job re-forms live without it. Timing bounds come from configured values only: the survivors' collectives fail no
sooner than one lease after the stop, and they compute again long before the group's timeout would have fired.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from axond.testing import run_threads
from live_train import GROUP_TIMEOUT_S, Hashes, build_trainer
from worker_support import Procs, free_port, pid_alive, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_train.py"
HEARTBEAT_S, MISSED = 0.2, 5
LEASE_S = HEARTBEAT_S * MISSED
HANG_STEP = 20
"""The step after which rank 2 waits (then is stopped) of the 60 the run takes (3 epochs of 20 steps)."""
STEPS = 60


def start_job(procs: Procs, out: Path) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed", str(MISSED), "--settle-time", "5")
    return [procs.axond("worker", "--coordinator", f"127.0.0.1:{port}", "--nnodes", "2:3", "--job", "frozen",
                        "--live-recovery", "--join-timeout", "60", "--stop-grace", "1",
                        "--", PY, str(SCRIPT), str(out), str(HANG_STEP)) for _ in range(3)]


def read(out: Path, pattern: str) -> dict[int, Any]:
    return {int(p.name.split("-")[-1].split(".")[0]): json.loads(p.read_text()) for p in out.glob(pattern)}


@pytest.mark.slow
def test_a_sigstopped_rank_is_killed_after_the_lease_and_the_survivors_go_on_bit_identical(
        procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "frozen"
    out.mkdir()
    workers = start_job(procs, out)
    wait_for(lambda: any(out.glob("hang-*")), 60, "rank 2 to wait after its step")
    frozen = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    stopped_at = time.monotonic()
    os.kill(frozen, signal.SIGSTOP)
    try:
        # the frozen rank's worker kills it after one lease; the survivors re-form; the rest of the run is short
        finished = [procs.finish(w, timeout=GROUP_TIMEOUT_S + 60) for w in workers]
    finally:
        if pid_alive(frozen):  # never leave a stopped process behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
    assert not pid_alive(frozen)
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    loser = next(f for f in finished if f.code != 0)
    assert "rank 2 was stopped (SIGSTOP) for" in loser.stderr, loser.stderr[-1500:]
    assert "goes on without this node" in loser.stderr, loser.stderr[-1500:]

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=3).fit(3), 1, 120.0)
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    assert sorted(started.values()) == [0, 1, 2] and started[frozen] == 2  # three processes ever: none restarted
    ends = read(out, "end-*.json")
    assert set(ends) == set(started) - {frozen}  # ranks 0 and 1 finished in the processes they started in
    for pid, end in ends.items():
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP)
        assert "rank 2" in recovery["reason"] and "SIGSTOP" in recovery["reason"], recovery
        # not before the lease ran out (a short stop is no failure), and long before the group's timeout
        assert recovery["error_at"] - stopped_at >= LEASE_S, (recovery, stopped_at)
        assert recovery["reformed_at"] - stopped_at < GROUP_TIMEOUT_S, (recovery, stopped_at)
        done = [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))  # the cut step ran again, once
        assert [s["hash"] for s in done] == reference.hashes  # bit for bit an uninterrupted run, after every step
