"""Live recovery of FSDP on virtual ranks: a real `axond coordinator`, three `axond worker --live-recovery` nodes, and a
DistributedTrainer (parallel="fsdp" on three virtual ranks, no checkpoint directory) whose rank 2 is SIGKILLed
mid-training. Rank 2 alone held its shard's parameters' authority and optimizer state, and no rank held the whole
gradient; the survivors rebuild the shard from the buddy copy in rank 0's memory (or the replacement rank from its
worker daemon's memory), re-shard over the new world and go on bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from axond.testing import run_threads
from live_train import Hashes, build_trainer
from test_worker_live_zero import HANG_STEP, STEPS, _ends, _run, _steps
from worker_support import Procs, procs  # noqa: F401

FSDP = {"LIVE_TEST_PARALLEL": "fsdp"}


def reference(virtual: int = 3) -> list[str]:
    """The per-step hashes of one process carrying the virtual ranks under FSDP, never interrupted."""
    hashes = Hashes()
    run_threads(lambda g: build_trainer(g, [hashes], virtual_ranks=virtual, parallel="fsdp").fit(3), 1, 120.0)
    return hashes.hashes


def _one_recovery(end: dict[str, Any], world_after: int) -> dict[str, Any]:
    (recovery,) = end["recoveries"]
    assert (recovery["world_before"], recovery["world_after"], recovery["step"]) == (3, world_after, HANG_STEP)
    assert recovery["checkpoint"] is None, recovery  # nothing read from storage
    return recovery


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["after-step", "before-copy", "every-third-step"])
def test_fsdp_survivors_rebuild_the_lost_shard_from_its_buddy_copy_bit_identical(procs: Procs, tmp_path: Path,
                                                                                  stop: str) -> None:
    """after-step: rank 2's copy of the cut step landed in rank 0 and is used as is; before-copy: rank 2 stops before
    posting it, and rank 0 advances the copy of the step before by the gradient of rank 2's block, which the
    reduce-scatter routes to a buddy as well as to the block's carrier; every-third-step (copy_every=3): the last copy
    is of step 18, advanced by the gradients of steps 19 and 20 that rank 0 kept."""
    out = tmp_path / "fsdp"
    env = {**FSDP, "AXOND_TIMELINE": str(tmp_path / "timeline")}
    if stop == "before-copy":
        env["LIVE_TEST_HANG_IN"] = "post"
    if stop == "every-third-step":
        env["LIVE_TEST_COPY_EVERY"] = "3"
    finished, killed = _run(procs, out, env)
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    expected = reference()
    assert len(expected) == STEPS
    started = {int(p.name.split("-")[2]) for p in out.glob("start-*")}
    ends = _ends(out)
    assert len(started) == 3 and set(ends) == started - {killed}  # the survivors finished in their own processes
    for pid, end in ends.items():
        recovery = _one_recovery(end, 2)
        assert recovery["from_copies"] == [2], recovery  # rank 2's shard, from rank 0's memory
        assert recovery["replayed"] == ([] if stop == "after-step" else [2]), recovery
        done = _steps(out, pid)
        assert [s["step"] for s in done] == list(range(1, STEPS + 1))  # the cut step ran again, once
        assert [s["hash"] for s in done] == expected  # after every step, not only the last
        assert next(s for s in done if s["step"] == HANG_STEP + 1)["world"] == 2
        (trace,) = (tmp_path / "timeline").glob(f"rank-*-pid-{pid}.json")
        (reform,) = [e for e in json.loads(trace.read_text()) if e.get("name") == "live.reform"]
        assert reform["args"]["from_copies"] == [2] and reform["args"]["checkpoint"] is None


@pytest.mark.slow
def test_fsdp_replacement_rank_takes_the_lost_shard_from_its_worker_daemons_memory(procs: Procs,
                                                                                   tmp_path: Path) -> None:
    """No buddy copies (copy_every=None): rank 2's shard lives only in its worker daemon's memory; its worker
    (--max-restarts 1) re-joins, and its new rank offers that copy: three ranks again, bit-identical."""
    out = tmp_path / "daemon"
    finished, killed = _run(procs, out, {**FSDP, "LIVE_TEST_COPY_EVERY": "none"}, restarts=1)
    assert [f.code for f in finished] == [0, 0, 0], "\n----\n".join(f.stderr[-4000:] for f in finished)
    expected = reference()
    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    ends = _ends(out)
    assert len(started) == 4 and killed in started and killed not in ends and len(ends) == 3
    (new,) = [pid for pid in ends if started[pid] == 2 and pid != killed]
    for pid, end in ends.items():
        done = _steps(out, pid)
        if pid == new:  # it joined at the boundary after HANG_STEP, its shard from the daemon's memory
            assert [s["hash"] for s in done] == expected[HANG_STEP:]
            continue
        recovery = _one_recovery(end, 3)
        assert recovery["from_copies"] == [2] and recovery["from_daemon"] == [2], recovery
        assert [s["hash"] for s in done] == expected


@pytest.mark.slow
def test_fsdp_without_copies_falls_back_to_the_checkpoint_or_fails_clearly(procs: Procs, tmp_path: Path) -> None:
    """Both copies of rank 2's shard gone (copies off, its worker not re-joining): with a checkpoint the survivors read
    it, say so and end bit-identical; without one they fail naming the shard, never going on with wrong state."""
    finished, _ = _run(procs, tmp_path / "bare", {**FSDP, "LIVE_TEST_COPY_EVERY": "none"})
    assert all(f.code != 0 for f in finished), [f.code for f in finished]
    assert sum("virtual shard(s) [2]" in f.stderr and "no checkpoint to fall back to" in f.stderr
               for f in finished) == 2, [f.stderr[-1500:] for f in finished]
    assert not _ends(tmp_path / "bare")

    out = tmp_path / "stored"
    finished, _ = _run(procs, out, {**FSDP, "LIVE_TEST_COPY_EVERY": "none"}, str(tmp_path / "checkpoints"))
    assert sorted(f.code for f in finished)[:2] == [0, 0], [f.stderr[-1500:] for f in finished]
    assert any("falling back to the checkpoint" in f.stderr for f in finished)
    expected = reference()
    for pid, end in _ends(out).items():
        (recovery,) = end["recoveries"]
        assert recovery["checkpoint"] is not None and recovery["from_copies"] == []
        done = _steps(out, pid)
        assert done[-1]["step"] == STEPS and [s["hash"] for s in done][-STEPS + HANG_STEP:] == expected[HANG_STEP:]
