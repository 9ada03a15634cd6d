"""torch DDP over "axond" through a rank's death: a real `axond coordinator`, three `axond worker --live-recovery`
nodes of one rank each, `axond.torch.live.Manager` (tests/helpers/live_torch_ddp.py), rank 2 SIGKILLed mid-training.

Timing bounds come from the coordinator's configured lease (heartbeat interval x missed heartbeats): the survivors
must compute again before the lease would even have declared the failed node dead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from live_torch_ddp import STEPS, reference
from worker_support import Finished, Procs, free_port, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_torch_ddp.py"
HEARTBEAT_S, MISSED = 0.2, 15
LEASE_S = HEARTBEAT_S * MISSED
HANG_STEP = 15
RTOL = 1e-5
"""The issue's bound for torch: at world size 2 DDP sums the virtual ranks' gradients in another order than the
one-process reference (float rounding), so the loss agrees to rounding, not bit for bit."""


def coordinator(procs: Procs) -> str:
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed", str(MISSED), "--settle-time", "5")
    return f"127.0.0.1:{port}"


def run_three(procs: Procs, out: Path, *args: str) -> tuple[list[Finished], int, float]:
    """Three workers (`--nnodes 2:3`, one rank each) running the script; SIGKILL the rank that stopped."""
    out.mkdir()
    address = coordinator(procs)
    workers = [procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--job", "torch-live",
                           "--live-recovery", "--join-timeout", "60", "--", PY, str(SCRIPT), str(out), *args)
               for _ in range(3)]
    wait_for(lambda: any(out.glob("hang-*")), 90, "rank 2 to stop at its step")
    killed = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    at = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    return [procs.finish(w, timeout=120) for w in workers], killed, at


def read_ends(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.split("-")[1].split(".")[0]): json.loads(p.read_text()) for p in out.glob("end-*.json")}


def steps(out: Path, pid: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]


def check_survivors(finished: list[Finished], out: Path, killed: int) -> dict[int, dict[str, Any]]:
    """Ranks 0 and 1 kept their processes and ended; their workers exit 0; every step committed once."""
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-2000:]) for f in finished]
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    assert sorted(started.values()) == [0, 1, 2] and started[killed] == 2  # three processes ever: none restarted
    ends = read_ends(out)
    assert set(ends) == set(started) - {killed}
    expected = reference()
    for pid, end in ends.items():
        assert end["steps"] == STEPS and end["world"] == 2, end
        assert [s["step"] for s in steps(out, pid)] == list(range(STEPS))  # no step lost, none applied twice
        assert end["final_loss"] == pytest.approx(expected, rel=RTOL), (end, expected)
    return ends


@pytest.mark.slow
def test_torch_ddp_survivors_keep_their_processes_and_the_loss(procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "live"
    finished, killed, kill_at = run_three(procs, out, str(HANG_STEP))
    ends = check_survivors(finished, out, killed)
    for pid, end in ends.items():
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP + 1)
        assert "rank 2" in recovery["reason"] and "137" in recovery["reason"], recovery
        assert not recovery["rolled_forward"]
        done = steps(out, pid)
        assert {s["world"] for s in done if s["step"] > HANG_STEP} == {2}
        assert {s["world"] for s in done if s["step"] <= HANG_STEP} == {3}
        # computing again long before the lease would have declared the killed node dead
        assert 0 < recovery["error_at"] - kill_at < recovery["reformed_at"] - kill_at < LEASE_S, (recovery, kill_at)


@pytest.mark.slow
def test_a_commit_cut_on_one_rank_is_applied_there_after_the_reformation(procs: Procs, tmp_path: Path) -> None:
    """Rank 1's commit of step HANG_STEP raises after its all-reduce completed everywhere: ranks 0 and 2 applied the
    step, rank 1 did not; after rank 2's death the survivors agree, rank 1 applies it, and nobody runs it again."""
    out = tmp_path / "cut"
    finished, killed, _ = run_three(procs, out, str(HANG_STEP), str(HANG_STEP))
    ends = check_survivors(finished, out, killed)
    by_rank = {end["start_rank"]: end for end in ends.values()}
    (r0,), (r1,) = by_rank[0]["recoveries"], by_rank[1]["recoveries"]
    assert (r0["step"], r0["rolled_forward"]) == (HANG_STEP + 1, False), r0
    assert (r1["step"], r1["rolled_forward"]) == (HANG_STEP, True), r1
    pid1 = next(pid for pid, end in ends.items() if end["start_rank"] == 1)
    rolled = next(s for s in steps(out, pid1) if s["step"] == HANG_STEP)
    assert rolled["world"] == 2 and rolled["loss"] is None  # applied after the re-formation, in the new generation
