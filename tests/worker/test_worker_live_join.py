"""Joining back end to end: a real `axond coordinator`, three `axond worker --live-recovery --nnodes 2:3` nodes and a
DistributedTrainer (ddp, virtual ranks, no checkpoint directory). Rank 2 is SIGKILLed (3 -> 2), then a replacement
`axond worker` joins the running job (2 -> 3): the survivors keep their processes, the new rank takes the state from
a live peer over the data plane, and every step's parameters equal an uninterrupted three-rank run's, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axond.testing import run_threads
from live_train import Hashes, build_trainer
from worker_support import Procs, free_port, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_train.py"
HEARTBEAT_S, MISSED = 0.2, 15
HANG_STEP = 20
"""Rank 2 stops after this step (then is SIGKILLed) of the 60 the run takes (3 epochs of 20 steps)."""
JOIN_STEP = 30
"""The survivors wait after this step until their workers say the job grows: the replacement joins here."""
STEPS = 60


def coordinator(procs: Procs) -> str:
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed", str(MISSED), "--settle-time", "5")
    return f"127.0.0.1:{port}"


def worker(procs: Procs, address: str, out: Path, max_restarts: int = 0,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--job", "grow", "--live-recovery",
                       "--join-timeout", "60", "--max-restarts", str(max_restarts),
                       "--", PY, str(SCRIPT), str(out), str(HANG_STEP),
                       env={"LIVE_TEST_WAIT_JOIN": str(JOIN_STEP)} if env is None else env)


def read(out: Path, pattern: str) -> dict[int, Any]:
    return {int(p.name.split("-")[-1].split(".")[0]): json.loads(p.read_text()) for p in out.glob(pattern)}


def steps(out: Path, pid: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]


def reference(parallel: str = "ddp") -> tuple[list[str], dict[str, np.ndarray]]:
    """The uninterrupted run: three virtual ranks in one process (the same bits as three ranks)."""
    hashes = Hashes()

    def train(group: Any) -> dict[str, np.ndarray]:
        trainer = build_trainer(group, [hashes], virtual_ranks=3, parallel=parallel)
        trainer.fit(3)
        return {k: np.array(v) for k, v in trainer.module.state_dict().items()}

    (params,) = run_threads(train, 1, 120.0)
    return hashes.hashes, params


def kill_rank_two(out: Path) -> int:
    import os
    import signal

    wait_for(lambda: any(out.glob("hang-*")), 60, "rank 2 to stop at its step")
    pid = int(next(out.glob("hang-*")).name.removeprefix("hang-"))
    os.kill(pid, signal.SIGKILL)
    return pid


def check_run(out: Path, killed: int, ref_hashes: list[str], ref_params: dict[str, np.ndarray],
              anywhere: bool = False, sharded: bool = False) -> dict[str, Any]:
    """Survivors in their first processes, every step bit-identical, the newcomer's state from a live peer; it joined
    at HANG_STEP or JOIN_STEP (`anywhere`: at any boundary after HANG_STEP)."""
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    ends = read(out, "end-*.json")
    first = {pid for pid, rank in started.items() if pid != killed and rank in (0, 1) and pid in ends}
    assert len(first) == 2, (started, list(ends))  # ranks 0 and 1 ended in the processes they started in
    (new,) = set(ends) - first
    assert new not in (killed, *first) and len(started) == 4  # four processes ever: the killed one, one new
    joined = steps(out, new)
    at = joined[0]["step"] - 1  # the step boundary it joined at
    assert (HANG_STEP < at < STEPS if anywhere else at in (HANG_STEP, JOIN_STEP)), at
    assert [s["step"] for s in joined] == list(range(at + 1, STEPS + 1))
    assert [s["hash"] for s in joined] == ref_hashes[at:]
    for pid in first:
        end = ends[pid]
        assert end["world"] == 3, end
        moves = [(r["world_before"], r["world_after"], r["step"]) for r in end["recoveries"]]
        # the replacement joined a later boundary (3 -> 2 -> 3), or the re-forming one itself (3 -> 3)
        assert moves == ([(3, 2, HANG_STEP), (2, 3, at)] if at != HANG_STEP else [(3, 3, HANG_STEP)]), moves
        assert "joined" in end["recoveries"][-1]["reason"] or at == HANG_STEP, end["recoveries"]
        done = steps(out, pid)
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))  # nothing lost, nothing applied twice
        assert [s["hash"] for s in done] == ref_hashes
        assert [s["world"] for s in done if s["step"] == at + 1] == [3]
        (sent,) = end["transfers"]
        assert sent["step"] == at and not sent["received"] and sent["source"] == 0
    with np.load(out / f"params-{new}.npz") as f:
        for name, value in ref_params.items():
            assert np.array_equal(f[name], value), name
    (got,) = ends[new]["transfers"]
    assert got["received"] and got["step"] == at and (got["nbytes"] > 0) != sharded  # ZeRO-1: by re-sharding
    print(f"\njoined at the boundary after step {at} ({'3 -> 2 -> 3' if at != HANG_STEP else '3 -> 3'}); "
          f"state transfer to the new rank: {got['nbytes']} bytes in {got['seconds'] * 1e3:.1f} ms "
          f"({got['nbytes'] / max(got['seconds'], 1e-9) / 1e6:.1f} MB/s, small model, shared machine)")
    return got


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "zero", "fsdp"])
def test_a_replacement_worker_joins_the_running_job_and_ends_bit_identical(
        procs: Procs, tmp_path: Path, parallel: str) -> None:
    """Under ZeRO-1 (`parallel="zero"`) and FSDP (`"fsdp"`) the lost rank's shards come back from its buddy's copy
    (3 -> 2), and the replacement's block from the shards' carriers (2 -> 3)."""
    ref_hashes, ref_params = reference(parallel)
    out = tmp_path / "grow"
    out.mkdir()
    address = coordinator(procs)
    env = {"LIVE_TEST_WAIT_JOIN": str(JOIN_STEP), "LIVE_TEST_PARALLEL": parallel}
    workers = [worker(procs, address, out, env=env) for _ in range(3)]
    killed = kill_rank_two(out)
    wait_for(lambda: any(w.poll() is not None for w in workers), 60, "the killed rank's worker to leave the job")
    lost = next(w for w in workers if w.poll() is not None)
    gone = procs.finish(lost, timeout=10)
    assert gone.code != 0 and "goes on without this node" in gone.stderr, gone.stderr[-1500:]
    replacement = worker(procs, address, out, env=env)
    finished = [procs.finish(w, timeout=120) for w in [*workers, replacement] if w is not lost]
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-6000:] for f in finished)
    assert "this node joined the running job live (a new node: no restart counted" in finished[-1].stderr
    check_run(out, killed, ref_hashes, ref_params, sharded=parallel != "ddp")
    if parallel != "ddp":
        for end in read(out, "end-*.json").values():
            shrink = [r for r in end["recoveries"] if r["world_after"] == 2]
            assert all(r["from_copies"] == [2] for r in shrink), end["recoveries"]  # rank 2's shard, from its buddy


@pytest.mark.slow
def test_the_killed_ranks_own_worker_rejoins_for_one_restart(procs: Procs, tmp_path: Path) -> None:
    """With --max-restarts 1 the failed node's worker re-joins the job it left (counting that restart) instead of
    exiting: its new rank takes the state from a live peer, and the run ends bit-identical all the same."""
    ref_hashes, ref_params = reference()
    out = tmp_path / "rejoin"
    out.mkdir()
    address = coordinator(procs)
    workers = [worker(procs, address, out, max_restarts=1) for _ in range(3)]
    killed = kill_rank_two(out)
    finished = [procs.finish(w, timeout=120) for w in workers]
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-5000:] for f in finished)
    (back,) = [f for f in finished if "re-joining it as a replacement" in f.stderr]
    assert "re-joined after its rank failed: one restart counted" in back.stderr, back.stderr[-1500:]
    check_run(out, killed, ref_hashes, ref_params)


@pytest.mark.slow
def test_a_replacement_joining_mid_step_costs_the_survivors_at_most_that_step(procs: Procs, tmp_path: Path) -> None:
    """No gate at a fixed step: the survivors are wherever their steps are when the replacement is admitted (each
    step of world size 2 paced to 100 ms, and a gate only before the last one, so that the run outlasts the
    replacement's start); the first to see the new generation tells the other (whose collective, if it had begun its
    step, is cut: that step runs again at world size 3), and no step is lost or applied twice."""
    ref_hashes, ref_params = reference()
    out = tmp_path / "mid"
    out.mkdir()
    address = coordinator(procs)
    paced = {"LIVE_TEST_PACE_S": "0.1", "LIVE_TEST_WAIT_JOIN": str(STEPS - 1)}
    workers = [worker(procs, address, out, env=paced) for _ in range(3)]
    killed = kill_rank_two(out)
    wait_for(lambda: any(w.poll() is not None for w in workers), 60, "the killed rank's worker to leave the job")
    lost = next(w for w in workers if w.poll() is not None)
    assert procs.finish(lost, timeout=10).code != 0
    replacement = worker(procs, address, out, env=paced)
    finished = [procs.finish(w, timeout=120) for w in [*workers, replacement] if w is not lost]
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-6000:] for f in finished)
    check_run(out, killed, ref_hashes, ref_params, anywhere=True)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_job_started_at_min_grows_to_max_on_the_virtual_ranks_of_max(procs: Procs, tmp_path: Path,
                                                                       parallel: str) -> None:
    """Two of `--nnodes 2:3` start the job (after the settle time); it trains on three virtual ranks (the default in a
    live job: the most ranks it may grow to), so a third worker joins it at a step boundary and every step's
    parameters are those of an uninterrupted three-rank run (under FSDP the shards re-sharded from two ranks to
    three)."""
    ref_hashes, ref_params = reference(parallel)
    out = tmp_path / "min"
    out.mkdir()
    address = coordinator(procs)
    env = {"LIVE_TEST_WAIT_JOIN": str(JOIN_STEP), "LIVE_TEST_PARALLEL": parallel}
    first = [procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--job", "grow", "--live-recovery",
                         "--join-timeout", "60", "--", PY, str(SCRIPT), str(out), "-1", env=env) for _ in range(2)]
    wait_for(lambda: any(out.glob("steps-*")), 60, "the job to start training at two nodes")
    third = procs.axond("worker", "--coordinator", address, "--nnodes", "2:3", "--job", "grow", "--live-recovery",
                        "--join-timeout", "60", "--", PY, str(SCRIPT), str(out), "-1", env=env)
    finished = [procs.finish(w, timeout=120) for w in [*first, third]]
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-6000:] for f in finished)
    ends = read(out, "end-*.json")
    assert len(ends) == 3 and len(list(out.glob("start-*"))) == 3
    for pid, end in ends.items():
        log = steps(out, pid)
        joined = bool(end["transfers"]) and end["transfers"][0]["received"]
        begin = JOIN_STEP + 1 if joined else 1
        assert [s["step"] for s in log] == list(range(begin, STEPS + 1))
        assert [s["hash"] for s in log] == ref_hashes[begin - 1:]
        assert [s["world"] for s in log if s["step"] in (JOIN_STEP, JOIN_STEP + 1)] == ([3] if joined else [2, 3])
        with np.load(out / f"params-{pid}.npz") as f:
            assert all(np.array_equal(f[k], v) for k, v in ref_params.items())
    assert sum(bool(e["transfers"]) and e["transfers"][0]["received"] for e in ends.values()) == 1
