"""Replicas that agree: one exponent bit flipped in one replica's parameters is caught at the next digest, named, and
the run rolls back to the last agreed checkpoint and ends with the parameters of a fault-free run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axond.distributed import ProcessGroup
from axond.distributed.diagnostics.failure import write_error_file
from axond.testing import RankFailed, run_threads
from axond.train import Callback, DistributedTrainer, ReplicaDivergence, check_replicas, replica_digest
from axond.train.digest import disagreeing
from axond.worker.blame import describe, pick
from axond.worker.launcher import RankExit, read_error_peer, read_error_record
from trainer_cases import final_params, make_trainer

WORLD = 4
FLIP_RANK, FLIP_STEP = 2, 13
EXPONENT_BIT = 1 << 23  # the lowest exponent bit of a float32: the weight doubles or halves


class FlipBit(Callback):
    """After global step `step` (the first time only), flip one exponent bit of one weight on `rank`."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.done = rank, step, False

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        if trainer.rank == self.rank and metrics["global_step"] == self.step and not self.done:
            self.done = True
            weight = next(iter(trainer.module.parameters())).data
            weight.reshape(-1).view(np.uint32)[3] ^= EXPONENT_BIT


Outcome = tuple[dict[str, np.ndarray], list[Any], list[str]]
"""Final parameters, the divergences seen, rank 0's trainer warnings."""


def _train(g: ProcessGroup, directory: Path | None, fault: bool, flip_step: int = FLIP_STEP, **options: Any) -> Outcome:
    """fit(3): 27 steps (72 samples / 4 ranks / batch 2 = 9 steps per epoch), a digest every 10, checkpoints every 3."""
    callbacks = [FlipBit(FLIP_RANK, flip_step)] if fault else []
    opts: dict[str, Any] = dict(batch_size=2, digest_every=10, callbacks=callbacks)
    opts.update(options)
    t = make_trainer(g, directory, **opts)
    seen: list[Any] = []
    if g.rank == 0:  # the one that warns (catch_warnings swaps process-wide state: one thread only)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t.fit(3)
    else:
        t.fit(3)
    assert t.replicas is not None
    return final_params(t), t.replicas.divergences, [str(w.message) for w in seen if "axond.train" in str(w.message)]


# ZeRO's step re-gathers every parameter from the rank that owns it: a bit flipped between steps heals (or, in the
# owner, spreads to every replica); what the check sees is a replica that differs after the gather (flip at step 20).
@pytest.mark.parametrize(("parallel", "flip_step"), [("ddp", FLIP_STEP), ("zero", 20)])
def test_a_flipped_exponent_bit_is_caught_named_and_rolled_back(tmp_path: Path, parallel: str, flip_step: int) -> None:
    clean = run_threads(lambda g: _train(g, tmp_path / "clean", False, parallel=parallel), WORLD, 120.0)
    for params, divergences, warned in clean:
        assert divergences == [] and warned == [], "no false alarm in a fault-free run"

    faulty = run_threads(lambda g: _train(g, tmp_path / "faulty", True, flip_step, parallel=parallel), WORLD, 120.0)
    for rank, (params, divergences, warned) in enumerate(faulty):
        assert len(divergences) == 1, divergences
        d = divergences[0]
        assert d.ranks == [FLIP_RANK] and d.step == 20 and d.peer == FLIP_RANK, "caught at the next digest"
        assert "group rank(s) [2] (rank 2 on " in str(d) and "3 of 4 ranks agree" in str(d)
        assert len(d.hosts) == 1 and d.hosts[0]
        if rank == 0:
            assert len(warned) == 1 and "rolling back every rank to" in warned[0] and "step_000000009" in warned[0]
        for name, value in clean[rank][0].items():
            np.testing.assert_array_equal(params[name], value, err_msg=f"rank {rank} {name} after the rollback")
    assert (tmp_path / "faulty" / "step_000000027").is_dir()


def test_without_an_agreed_checkpoint_every_rank_raises_naming_the_rank(tmp_path: Path) -> None:
    def run(g: ProcessGroup) -> str:
        with pytest.raises(ReplicaDivergence) as e:
            _train(g, None, True, checkpoint_every=None)
        assert e.value.ranks == [FLIP_RANK] and e.value.step == 20
        write_error_file(e.value, str(tmp_path / f"error.{g.rank}.json"))  # what the worker reads
        assert json.loads((tmp_path / f"error.{g.rank}.json").read_text())["peer"] == FLIP_RANK, "the file blames it"
        return str(e.value)

    messages = run_threads(run, WORLD, 120.0)
    assert len(set(messages)) == 1
    exits = []  # what `axond worker` makes of the four error files: rank 2 is the root cause, the others follow
    for r in range(WORLD):
        path = str(tmp_path / f"error.{r}.json")
        text, when = read_error_record(path)
        exits.append(RankExit(r, r, 1, text, failed_at=when or 0.0, blames=read_error_peer(path), reported=True))
    root = pick(exits)
    assert root is not None and root.rank == FLIP_RANK and "ReplicaDivergence: replicas disagree" in root.message
    assert "then ranks 0, 1, 3 failed because of it" in describe(root, exits)
    assert "replicas disagree after step 20" in messages[0] and "no agreed checkpoint" in messages[0]
    assert "restart the job without that node" in messages[0]


def test_check_replicas_names_the_odd_rank_or_both_of_two() -> None:
    def odd_one(g: ProcessGroup) -> list[int]:
        params = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.float64)]
        if g.rank == 1:
            params[1].view(np.uint64)[2] ^= np.uint64(1 << 52)
        return check_replicas(params, g)

    assert run_threads(odd_one, 3, 60.0) == [[1]] * 3
    assert run_threads(odd_one, 2, 60.0) == [[0, 1]] * 2, "no majority of two: both named"
    assert disagreeing([7, 7, 7]) == [] and disagreeing([1, 1, 2, 2]) == [0, 1, 2, 3]
    a = np.linspace(0, 1, 100, dtype=np.float32)
    assert replica_digest([a]) == replica_digest([a.copy()]) < 2**64
    assert replica_digest([a[::2]]) == replica_digest([np.ascontiguousarray(a[::2])]), "strided views"
    odd = [np.linspace(-3, 3, 7, dtype=np.float32), np.arange(3, dtype=np.float64)]  # 28 bytes: a partial word
    base = replica_digest(odd)
    for k, arr in enumerate(odd):
        for bit in range(arr.nbytes * 8):
            flipped = [x.copy() for x in odd]
            flipped[k].view(np.uint8)[bit // 8] ^= np.uint8(1 << bit % 8)
            assert replica_digest(flipped) != base, f"parameter {k} bit {bit} flipped"


def test_digest_every_needs_replicated_parameters(tmp_path: Path) -> None:
    with pytest.raises(RankFailed, match="digest_every must be >= 1 and needs replicated parameters"):
        run_threads(lambda g: make_trainer(g, tmp_path, digest_every=10, parallel="fsdp"), 1, 60.0)
    with pytest.raises(RankFailed, match="digest_every must be >= 1"):
        run_threads(lambda g: make_trainer(g, tmp_path, digest_every=0), 1, 60.0)


def test_the_checkpoint_a_fit_resumed_from_is_a_rollback_target(tmp_path: Path) -> None:
    """fit(1) ends at step 9 before any check; the next fit resumes there, passes the check at 10, and rolls back to
    the step-9 checkpoint it resumed from when rank 2 diverges at 13."""
    clean = run_threads(lambda g: _train(g, tmp_path / "clean", False), WORLD, 120.0)

    def resumed(g: ProcessGroup) -> Outcome:
        make_trainer(g, tmp_path / "resumed", batch_size=2, digest_every=10).fit(1)
        return _train(g, tmp_path / "resumed", True)

    for rank, (params, divergences, _) in enumerate(run_threads(resumed, WORLD, 120.0)):
        assert [d.step for d in divergences] == [20]
        for name, value in clean[rank][0].items():
            np.testing.assert_array_equal(params[name], value, err_msg=f"rank {rank} {name} after the rollback")
