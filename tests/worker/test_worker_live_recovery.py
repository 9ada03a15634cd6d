"""Live recovery end to end: a real `axond coordinator`, three `axond worker --live-recovery` nodes, and a
DistributedTrainer (ddp, no checkpoint directory) whose rank is SIGKILLed mid-training.

Timing bounds come from the coordinator's configured lease (heartbeat interval x missed heartbeats): the survivors
must compute again before the lease would even have declared the failed node dead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond
from axond.fencing import FENCE_MARGIN_S, fence_wait
from axond.testing import run_threads
from live_train import Hashes, build_trainer
from worker_support import Finished, Procs, free_port, pid_alive, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_train.py"
HEARTBEAT_S, MISSED = 0.2, 15
LEASE_S = HEARTBEAT_S * MISSED
HANG_STEP = 20
"""The step after which rank 2 stops (then is killed) of the 60 the run takes (3 epochs of 20 steps)."""
STEPS = 60
SETTLE_S = "5"
"""Long enough for the three workers to join before the first generation freezes (it freezes at once with all three;
a live re-formation waits for its survivors only, never for the settle time)."""


def coordinator(procs: Procs) -> str:
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed", str(MISSED), "--settle-time", SETTLE_S)
    return f"127.0.0.1:{port}"


def worker(procs: Procs, address: str, out: Path, hang: int, nproc: int = 1, role: str = "",
           stop_grace: float = 5.0, timeline: Path | None = None) -> subprocess.Popen[str]:
    env = {"LIVE_TEST_ROLE": role} if role else {}
    if timeline is not None:
        env["AXOND_TIMELINE"] = str(timeline)
    return procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--nproc-per-node", str(nproc),
                       "--job", "live", "--live-recovery", "--join-timeout", "60", "--stop-grace", str(stop_grace),
                       "--", PY, str(SCRIPT), str(out), str(hang), env=env)


def read(out: Path, pattern: str) -> dict[int, Any]:
    """The JSON files `pattern` (with its PID in the name) by PID."""
    return {int(p.name.split("-")[-1].split(".")[0]): json.loads(p.read_text()) for p in out.glob(pattern)}


def params(out: Path, pid: int) -> dict[str, np.ndarray]:
    with np.load(out / f"params-{pid}.npz") as f:
        return {k: f[k] for k in f.files}


def steps(out: Path, pid: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]


def kill_when_hung(out: Path, timeout: float = 60.0) -> tuple[int, float]:
    """SIGKILL the rank that stopped at HANG_STEP; returns (its pid, time.monotonic() of the kill)."""
    wait_for(lambda: any(out.glob("hang-*")), timeout, "the rank to stop at its step")
    pid = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return pid, at


def run_three(procs: Procs, out: Path, hang: int,
              timeline: Path | None = None) -> tuple[list[Finished], int, float]:
    out.mkdir()
    address = coordinator(procs)
    workers = [worker(procs, address, out, hang, timeline=timeline) for _ in range(3)]
    killed, at = kill_when_hung(out) if hang >= 0 else (0, 0.0)
    return [procs.finish(w, timeout=90) for w in workers], killed, at


@pytest.mark.slow
def test_survivors_of_a_killed_rank_keep_their_processes_and_end_bit_identical(procs: Procs, tmp_path: Path) -> None:
    ref, _, _ = run_three(procs, tmp_path / "ref", -1)
    assert [f.code for f in ref] == [0, 0, 0], [f.stderr[-2000:] for f in ref]
    ref_pid = next(iter(read(tmp_path / "ref", "end-*.json")))
    reference = params(tmp_path / "ref", ref_pid)
    ref_hashes = [s["hash"] for s in steps(tmp_path / "ref", ref_pid)]

    out = tmp_path / "live"
    finished, killed, kill_at = run_three(procs, out, HANG_STEP, timeline=tmp_path / "timeline")
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    loser = next(f for f in finished if f.code != 0)
    assert "goes on without this node" in loser.stderr, loser.stderr[-1500:]

    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    assert sorted(started.values()) == [0, 1, 2] and started[killed] == 2  # three processes ever: none restarted
    ends = read(out, "end-*.json")
    assert set(ends) == set(started) - {killed}  # ranks 0 and 1 finished in the processes they started in
    for pid, end in ends.items():
        assert (end["world"], int(end["generation"])) == (2, int(end["first_generation"]) + 1), end
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP)
        assert "rank 2" in recovery["reason"] and "137" in recovery["reason"], recovery
        done = steps(out, pid)
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))  # the cut step ran again, once, nothing lost
        assert [s["hash"] for s in done] == ref_hashes  # the parameters after every step, not only the last
        resumed = next(s for s in done if s["step"] == HANG_STEP + 1)
        assert resumed["world"] == 2
        # computing again long before the lease would have declared the killed node dead
        first_step_after = recovery["reformed_at"] - kill_at
        assert 0 < recovery["error_at"] - kill_at < LEASE_S and first_step_after < LEASE_S, (recovery, kill_at)
        got = params(out, pid)
        for name, value in reference.items():
            assert np.array_equal(got[name], value), name  # bit for bit the uninterrupted three-rank run
        (trace,) = (tmp_path / "timeline").glob(f"rank-*-pid-{pid}.json")  # the failure and replay, on the timeline
        events = json.loads(trace.read_text())
        (reform,) = [e for e in events if e.get("name") == "live.reform"]
        assert reform["args"]["world_after"] == 2 and reform["args"]["step"] == HANG_STEP
        spans = [e["args"]["step"] for e in events if e.get("name") == "train.step"]
        assert spans == list(range(1, STEPS + 1))
        replay = next(e for e in events if e.get("name") == "train.step" and e["args"]["step"] == HANG_STEP + 1)
        assert replay["ts"] >= reform["ts"] + reform["dur"] and replay["args"]["world"] == 2


@pytest.mark.slow
def test_the_failed_nodes_old_generation_never_runs_beside_the_new_one(procs: Procs, tmp_path: Path) -> None:
    """The failed node's other rank ignores SIGTERM and stamps the time until its worker SIGKILLs it (after
    --stop-grace): the survivors' new generation forms only after its last stamp."""
    out = tmp_path / "fence"
    out.mkdir()
    address = coordinator(procs)
    stubborn = worker(procs, address, out, HANG_STEP, nproc=2, role="stubborn", stop_grace=1.0)
    others = [worker(procs, address, out, HANG_STEP, role="bystander") for _ in range(2)]
    wait_for(lambda: any(out.glob("alive-*")), 60, "the stubborn rank to start stamping")
    kill_when_hung(out)
    results = [procs.finish(w, timeout=90) for w in [stubborn, *others]]
    assert results[0].code != 0 and [r.code for r in results[1:]] == [0, 0], [r.stderr[-1500:] for r in results]
    alive = next(out.glob("alive-*"))
    assert not pid_alive(int(alive.name.removeprefix("alive-")))
    last_stamp = float(alive.read_text())
    ends = read(out, "end-*.json")
    assert len(ends) == 2
    for end in ends.values():
        (recovery,) = end["recoveries"]
        assert recovery["world_after"] == 2 and recovery["world_before"] == 4
        assert last_stamp < recovery["reformed_at"], (last_stamp, recovery)


@pytest.mark.slow
def test_user_code_catches_membership_changed_and_reforms_in_place(procs: Procs, tmp_path: Path) -> None:
    out = tmp_path / "collectives"
    out.mkdir()
    address = coordinator(procs)
    script = SCRIPT.with_name("live_collectives.py")
    workers = [procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--job", "loop", "--live-recovery",
                           "--join-timeout", "60", "--", PY, str(script), str(out)) for _ in range(3)]
    kill_when_hung(out)
    codes = sorted(procs.finish(w, timeout=90).code for w in workers)
    assert codes[:2] == [0, 0] and codes[2] != 0
    ends = read(out, "end-*.json")
    assert sorted(e["start_rank"] for e in ends.values()) == [0, 1]
    for end in ends.values():
        (caught,) = end["caught"]
        assert caught["distributed_error"] and caught["generation"] == caught["previous"] + 1
        assert "rank 2" in caught["reason"] and "SIGKILL" in caught["reason"], caught
        assert caught["size"] == 2 and caught["rank"] == end["start_rank"]
        assert caught["env"] == {"RANK": str(caught["rank"]), "WORLD_SIZE": "2",
                                 "AXOND_GENERATION": str(caught["generation"])}
        assert len(end["sums"]) == 30 and set(end["sums"][:10]) == {3.0} and end["sums"][-1] == 2.0


def test_reform_outside_a_live_job_says_what_to_do() -> None:
    with pytest.raises(axond.DistributedError, match="--live-recovery"):
        axond.reform()


@pytest.mark.slow
def test_a_lost_host_is_fenced_then_the_survivors_go_on_bit_identical(procs: Procs, tmp_path: Path) -> None:
    """Every process of one host killed (its worker too): the coordinator declares the node dead after its lease,
    waits out the fence, and only then re-forms the survivors, who go on as after a rank's death."""
    out = tmp_path / "host"
    out.mkdir()
    address = coordinator(procs)
    workers = [worker(procs, address, out, HANG_STEP) for _ in range(3)]
    wait_for(lambda: any(out.glob("hang-*")), 60, "rank 2 to stop at its step")
    rank = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    with open(f"/proc/{rank}/stat") as f:
        its_worker = int(f.read().rsplit(")", 1)[1].split()[1])  # the rank's parent: the worker of its host
    assert its_worker in [w.pid for w in workers]
    killed = time.monotonic()
    for pid in (its_worker, rank):
        os.kill(pid, signal.SIGKILL)
    finished = {w.pid: procs.finish(w, timeout=90) for w in workers}
    assert [f.code for pid, f in finished.items() if pid != its_worker] == [0, 0], [
        f.stderr[-1500:] for f in finished.values()]

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=3).fit(3), 1, 120.0)
    fence = fence_wait(LEASE_S, HEARTBEAT_S, FENCE_MARGIN_S)
    ends = read(out, "end-*.json")
    assert len(ends) == 2
    for pid, end in ends.items():
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP)
        assert "missed" in recovery["reason"], recovery  # declared dead by its lease, not reported by its worker
        # never two generations at once: not before the lease (less the heartbeat it may have sent last) and fence
        assert recovery["reformed_at"] - killed >= LEASE_S - HEARTBEAT_S + fence, recovery
        assert recovery["reformed_at"] - killed < LEASE_S + fence + 10 * HEARTBEAT_S, recovery
        assert [s["hash"] for s in steps(out, pid)] == reference.hashes


@pytest.mark.slow
def test_a_job_submitted_with_axond_run_recovers_live_on_worker_daemons(procs: Procs, tmp_path: Path) -> None:
    """`axond run --nnodes 2:3 --live-recovery` on three worker daemons: the same path as three agents."""
    out = tmp_path / "run"
    out.mkdir()
    address = coordinator(procs)
    for _ in range(3):
        procs.axond("worker", "--coordinator", address, "--slots", "1")
    run = procs.axond("run", "--coordinator", address, "--nnodes", "2:3", "--live-recovery", "--job", "daemons",
                      "--", PY, str(SCRIPT), str(out), str(HANG_STEP))
    killed, _ = kill_when_hung(out)
    done = procs.finish(run, timeout=90)
    assert done.code == 0, done.stderr[-2000:]
    assert "re-forming live as generation 2: rank 2" in done.stderr, done.stderr[-2000:]
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}
    assert sorted(started.values()) == [0, 1, 2] and started[killed] == 2  # none restarted
    ends = read(out, "end-*.json")
    assert set(ends) == set(started) - {killed}
    reference = Hashes()
    run_threads(lambda group: build_trainer(group, [reference], virtual_ranks=3).fit(3), 1, 120.0)
    for pid in ends:  # every step's parameters those of an uninterrupted run on three virtual ranks
        assert [s["hash"] for s in steps(out, pid)] == reference.hashes
    for end in ends.values():
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP)


def test_axond_run_takes_a_range_of_nodes_only_with_live_recovery(procs: Procs) -> None:
    res = procs.run("run", "--coordinator", "127.0.0.1:1", "--nnodes", "2:3", "--", PY, "-c", "pass", timeout=30)
    assert res.code == 2 and "--live-recovery" in res.stderr, res.stderr
