"""Live recovery of sharded state, ZeRO-1 and FSDP on virtual ranks: a real `axond coordinator`, three
`axond worker --live-recovery` nodes, and a DistributedTrainer (parallel="zero" or "fsdp" on three virtual ranks, no
checkpoint directory) whose rank 2 is SIGKILLed mid-training. Rank 2 alone held its shard's optimizer state (under
FSDP also its parameters' authority, and no rank held the whole gradient); the survivors rebuild the shard from the
buddy copy in rank 0's memory (or the replacement rank from its worker daemon's memory), re-shard over the new world
and go on bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from axond.testing import run_threads
from live_train import Hashes, build_trainer
from worker_support import Finished, Procs, free_port, procs, wait_for  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_train.py"
HEARTBEAT_S, MISSED = 0.2, 10
HANG_STEP, STEPS = 20, 60
BOTH = pytest.mark.parametrize("parallel", ["zero", "fsdp"])


def _steps(out: Path, pid: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]


def _run(procs: Procs, out: Path, parallel: str, env: dict[str, str], *extra: str, restarts: int = 0,
         nodes: int = 3, whole: str = "") -> tuple[list[Finished], int]:
    """`nodes` live workers training under `parallel`; rank 2 (and the others of LIVE_TEST_HANG_RANKS) SIGKILLed at
    once when they stopped after HANG_STEP, the worker of rank `whole` first; (finished, rank 2's pid)."""
    out.mkdir()
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", str(HEARTBEAT_S), "--dead-after-missed", str(MISSED), "--settle-time", "5")
    workers = [procs.axond("worker", "--coordinator", f"127.0.0.1:{port}", "--nnodes", f"2:{nodes}", "--job", "zero",
                           "--live-recovery", "--join-timeout", "60", "--max-restarts", str(restarts), "--", PY,
                           str(SCRIPT), str(out), str(HANG_STEP), *extra,
                           env={"LIVE_TEST_PARALLEL": parallel, **env})
               for _ in range(nodes)]
    stopping = env.get("LIVE_TEST_HANG_RANKS", "2").split(",")
    wait_for(lambda: len(list(out.glob("hang-*"))) == len(stopping), 60, f"rank(s) {stopping} to stop after the step")
    pids = {int(p.name.removeprefix("hang-")) for p in out.glob("hang-*")}
    rank_of = {int(p.name.split("-")[2]): p.name.split("-")[1] for p in out.glob("start-*")}
    if whole:  # the node lost whole: its worker daemon (the memory it kept) goes before its rank
        rank_pid = next(pid for pid in pids if rank_of[pid] == whole)
        os.kill(int(Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed = next(pid for pid in pids if rank_of[pid] == "2")
    return [procs.finish(w, timeout=90) for w in workers], killed


def _reference(parallel: str, virtual_ranks: int = 3) -> list[str]:
    """The per-step hashes of one process carrying the virtual ranks under `parallel`, never interrupted."""
    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=virtual_ranks, parallel=parallel).fit(3), 1,
                120.0)
    assert virtual_ranks != 3 or len(reference.hashes) == STEPS
    return reference.hashes


def _ends(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.removeprefix("end-").removesuffix(".json")): json.loads(p.read_text())
            for p in out.glob("end-*.json")}


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["after-step", "before-copy", "every-third-step"])
@BOTH
def test_survivors_rebuild_the_lost_shard_from_its_buddy_copy_bit_identical(procs: Procs, tmp_path: Path,
                                                                             parallel: str, stop: str) -> None:
    """after-step: rank 2's copy of the cut step landed in rank 0 and is used as is; before-copy: rank 2 stops before
    posting it (its buddy waits for it and is cut there), and rank 0 advances the copy of the step before by the kept
    gradient (under FSDP, of rank 2's block, which the reduce-scatter routes to a buddy as well as to the block's
    carrier); every-third-step (copy_every=3): the last copy is of step 18, advanced by the gradients of steps 19 and
    20 that rank 0 kept."""
    out = tmp_path / parallel
    env = {"AXOND_TIMELINE": str(tmp_path / "timeline")}
    if stop == "before-copy":
        env["LIVE_TEST_HANG_IN"] = "post"
    if stop == "every-third-step":
        env["LIVE_TEST_COPY_EVERY"] = "3"
    finished, killed = _run(procs, out, parallel, env)
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    reference = _reference(parallel)
    started = {int(p.name.split("-")[2]) for p in out.glob("start-*")}
    ends = _ends(out)
    assert len(started) == 3 and set(ends) == started - {killed}  # the survivors finished in their own processes
    for pid, end in ends.items():
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 2, HANG_STEP), recovery
        assert recovery["from_copies"] == [2] and recovery["checkpoint"] is None  # rank 2's shard, from memory
        assert end["relayed"] and end["unsent"] == 0  # the copies went through the workers, every one kept
        assert recovery["replayed"] == ([] if stop == "after-step" else [2]), recovery  # advanced from an older copy
        done = _steps(out, pid)
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))  # the cut step ran again, once
        assert [s["hash"] for s in done] == reference  # after every step, not only the last
        assert next(s for s in done if s["step"] == HANG_STEP + 1)["world"] == 2
        (trace,) = (tmp_path / "timeline").glob(f"rank-*-pid-{pid}.json")
        (reform,) = [e for e in json.loads(trace.read_text()) if e.get("name") == "live.reform"]
        assert reform["args"]["from_copies"] == [2] and reform["args"]["checkpoint"] is None


@pytest.mark.slow
@BOTH
def test_without_copies_falls_back_to_the_checkpoint_or_fails_clearly(procs: Procs, tmp_path: Path,
                                                                      parallel: str) -> None:
    """Both copies of rank 2's shard gone (copies off, its worker not re-joining): with a checkpoint the survivors
    read it, say so and end bit-identical; without one they fail naming the lost shard, never going on with wrong
    state."""
    finished, _ = _run(procs, tmp_path / "bare", parallel, {"LIVE_TEST_COPY_EVERY": "none"})
    assert all(f.code != 0 for f in finished), [f.code for f in finished]
    assert sum("virtual shard(s) [2]" in f.stderr and "no checkpoint to fall back to" in f.stderr
               for f in finished) == 2, [f.stderr[-1500:] for f in finished]
    assert not _ends(tmp_path / "bare")

    out = tmp_path / "stored"
    finished, _ = _run(procs, out, parallel, {"LIVE_TEST_COPY_EVERY": "none"}, str(tmp_path / "checkpoints"))
    assert sorted(f.code for f in finished)[:2] == [0, 0], [f.stderr[-1500:] for f in finished]
    assert any("falling back to the checkpoint" in f.stderr for f in finished)
    reference = _reference(parallel)
    for pid, end in _ends(out).items():
        (recovery,) = end["recoveries"]
        assert recovery["checkpoint"] is not None and recovery["from_copies"] == []
        done = _steps(out, pid)
        assert done[-1]["step"] == STEPS and [s["hash"] for s in done][-STEPS + HANG_STEP:] == reference[HANG_STEP:]


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "stop"), [
    pytest.param("zero", "after-step", id="zero-after-step"),
    pytest.param("zero", "before-copy", id="zero-before-copy"),
    pytest.param("fsdp", "after-step", id="fsdp-after-step"),
    # no fsdp-before-copy: under FSDP the replacement does not offer its daemon's copy of the step before (ZeRO-1's is
    # advanced by the cut step's gradient); every rank then raises that rank 2's shard was lost with both its copies
])
def test_a_replacement_rank_takes_the_lost_shard_from_its_worker_daemons_memory(procs: Procs, tmp_path: Path,
                                                                               parallel: str, stop: str) -> None:
    """No buddy copies at all (copy_every=None): rank 2's shard lives only in its worker daemon's memory. Its worker
    (--max-restarts 1) re-joins, the re-formation waits for it, and its new rank offers the copy the killed one left
    there: the job goes on at three ranks, bit-identical, nothing read from storage. before-copy (ZeRO-1): rank 2
    stops before copying step 20 into the daemon's memory; the copy of step 19 is advanced by step 20's gradient from a
    survivor."""
    out = tmp_path / "daemon"
    env = {"LIVE_TEST_COPY_EVERY": "none"}
    if stop == "before-copy":
        env["LIVE_TEST_HANG_IN"] = "daemon"
    finished, killed = _run(procs, out, parallel, env, restarts=1)
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-4000:] for f in finished)
    (back,) = [f for f in finished if "re-joining it as a replacement" in f.stderr]
    reference = _reference(parallel)
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    ends = _ends(out)
    assert len(started) == 4 and killed in started and killed not in ends and len(ends) == 3
    (new,) = [pid for pid in ends if started[pid] == 2 and pid != killed]
    for pid, end in ends.items():
        done = _steps(out, pid)
        if pid == new:  # it joined at the boundary after HANG_STEP, its shard from the daemon's memory
            assert [s["step"] for s in done] == list(range(HANG_STEP + 1, STEPS + 1))
            assert [s["hash"] for s in done] == reference[HANG_STEP:]
            (got,) = end["transfers"]
            assert got["received"] and got["step"] == HANG_STEP
            continue
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, 3, HANG_STEP), recovery
        assert recovery["from_copies"] == [2] and recovery["from_daemon"] == [2], recovery
        assert recovery["replayed"] == ([2] if stop == "before-copy" else []) and recovery["checkpoint"] is None
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))
        assert [s["hash"] for s in done] == reference


@pytest.mark.slow
@BOTH
def test_a_rank_killed_with_its_buddy_comes_back_from_its_worker_daemons_memory(procs: Procs, tmp_path: Path,
                                                                                parallel: str) -> None:
    """Four workers (--nnodes 2:4); ranks 2 and 3 SIGKILLed at once: rank 2's buddy copy was in rank 3, so both
    of its copies in ranks are gone. Both workers re-join as replacements (--max-restarts 2: one restart counted each),
    both awaited by the same re-formation, whichever reported first; the new rank 2 offers the shard from its worker
    daemon's memory, rank 3's shard comes from its copy in rank 0: four ranks again, every step bit-identical to an
    uninterrupted run, nothing read from storage."""
    out = tmp_path / "double"
    finished, killed = _run(procs, out, parallel, {"LIVE_TEST_HANG_RANKS": "2,3"}, restarts=2, nodes=4)
    assert [f.code for f in finished] == [0, 0, 0, 0], "\n----\n".join(f.stderr[-4000:] for f in finished)
    reference = _reference(parallel, virtual_ranks=4)
    steps = len(reference)
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    ends = _ends(out)
    assert len(started) == 6 and len(ends) == 4 and killed not in ends
    for pid, end in ends.items():
        done = _steps(out, pid)
        if started[pid] in (2, 3):  # a new rank: from the boundary after HANG_STEP on
            assert [s["hash"] for s in done] == reference[HANG_STEP:] and not end["recoveries"]
            continue
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (4, 4, HANG_STEP), recovery
        assert recovery["from_copies"] == [2, 3] and recovery["from_daemon"] == [2], recovery
        assert recovery["checkpoint"] is None
        assert [s["step"] for s in done] == list(range(1, steps + 1))
        assert [s["hash"] for s in done] == reference


@pytest.mark.slow
@BOTH
def test_a_rank_lost_with_its_buddy_rank_comes_back_from_the_copy_the_buddys_worker_holds(procs: Procs,
                                                                                          tmp_path: Path,
                                                                                          parallel: str) -> None:
    """Rank 2's node is lost whole (its worker daemon SIGKILLed, then its rank) and, at once, rank 0: the buddy rank
    that would have held rank 2's copy in its process. Rank 2's copy was sent to rank 0's worker, which lives
    (--max-restarts 1): its replacement rank offers that copy from the node's held memory, rank 0's own shard comes
    from its worker's memory or from its copy held by rank 1's worker. Two ranks go on bit-identical, nothing read
    from storage."""
    out = tmp_path / "buddy-rank"
    finished, killed = _run(procs, out, parallel, {"LIVE_TEST_HANG_RANKS": "2,0", "LIVE_TEST_HANG_AFTER_COPY": "1"},
                            restarts=1, whole="2")
    codes = sorted(f.code for f in finished)
    assert codes == [-signal.SIGKILL, 0, 0], "\n----\n".join(f.stderr[-4000:] for f in finished)
    reference = _reference(parallel)
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    ends = _ends(out)
    assert len(started) == 4 and len(ends) == 2 and killed not in ends
    for pid, end in ends.items():
        done = _steps(out, pid)
        assert end["world"] == 2 and end["relayed"], end
        assert [s["hash"] for s in done] == reference[len(reference) - len(done):]  # every step it ran, bit for bit
        if end["recoveries"]:  # rank 1, in its first process
            assert [s["step"] for s in done] == list(range(1, STEPS + 1))
            last = end["recoveries"][-1]
            assert 2 in last["from_copies"] and 2 not in last["from_daemon"], last  # from rank 0's node's memory
            assert all(r["checkpoint"] is None for r in end["recoveries"])
