"""Save at one world size, load at another: training continues exactly as an uninterrupted run would.

Real thread ranks over TCP. Each wrapper trains 2 steps on 3 ranks, saves, and a fresh model on 2 or
4 ranks (possibly another wrapper) loads and trains 2 more; the full parameters must equal 4
single-process steps on the same global batches (float32, reductions in another order: ~1e-5).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import axond.checkpoint as ckpt
from axond.distributed import ProcessGroup
from axond.testing import run_threads
from checkpoint_cases import build, reference, train


def _save_after(kind: str, steps: int, path: Path, world: int) -> None:
    def rank(g: ProcessGroup) -> None:
        model, opt = build(kind, g)
        train(model, opt, g.rank, g.size, range(steps))
        model_sd, optim_sd = ckpt.get_state_dict(model, opt)
        ckpt.save({"model": model_sd, "optim": optim_sd}, path, g)

    run_threads(rank, world, 60.0)


def _resume(kind: str, path: Path, out: Path, world: int, start: int, steps: int) -> None:
    def rank(g: ProcessGroup) -> None:
        model, opt = build(kind, g)
        model_sd, optim_sd = ckpt.get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        ckpt.load(sd, path, g)
        ckpt.set_state_dict(model, opt, sd["model"], sd["optim"])
        train(model, opt, g.rank, g.size, range(start, start + steps))
        ckpt.save({"model": ckpt.get_state_dict(model)[0]}, out, g)

    run_threads(rank, world, 60.0)


def _assert_params(out: Path, expected: dict[str, np.ndarray]) -> None:
    got = ckpt.load_full(out)
    assert list(got) == list(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=2e-6, err_msg=key)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("kind", ["ddp", "zero", "fsdp_full", "fsdp_grad_op"])
@pytest.mark.parametrize("world", [2, 4])
def test_save_at_3_resume_at_2_and_4(kind: str, world: int, tmp_path: Path) -> None:
    _save_after(kind, 2, tmp_path / "c", 3)
    _resume(kind, tmp_path / "c", tmp_path / "out", world, 2, 2)
    _assert_params(tmp_path / "out", reference(4))


@pytest.mark.parametrize("saved,loaded", [("fsdp_full", "ddp"), ("zero", "fsdp_full"), ("ddp", "fsdp_no_shard"),
                                          ("fsdp_hybrid", "fsdp_grad_op")])
def test_resume_under_another_wrapper(saved: str, loaded: str, tmp_path: Path) -> None:
    """The state is keyed by the unwrapped model's names, so the wrapper may change across a restart."""
    _save_after(saved, 2, tmp_path / "c", 4)
    _resume(loaded, tmp_path / "c", tmp_path / "out", 2, 2, 2)
    _assert_params(tmp_path / "out", reference(4))


def test_replicated_tensors_are_written_once(tmp_path: Path) -> None:
    """DDP replicas hold the same boxes: rank 0 writes them, the other ranks' files stay empty."""
    _save_after("ddp", 1, tmp_path / "c", 3)
    meta = ckpt.read_metadata(tmp_path / "c")
    assert meta.files["__1.distcp"] == meta.files["__2.distcp"] == 0 < meta.files["__0.distcp"]
    assert all(len(t.pieces) == 1 for t in meta.tensors.values())


def test_fsdp_pieces_come_from_every_rank(tmp_path: Path) -> None:
    _save_after("fsdp_full", 1, tmp_path / "c", 3)
    meta = ckpt.read_metadata(tmp_path / "c")
    assert all(size > 0 for size in meta.files.values()), meta.files
    exp_avg = meta.tensors["optim/state/0.weight/exp_avg"]
    assert {p.file for p in exp_avg.pieces} >= {"__0.distcp", "__1.distcp"}


def test_a_mismatched_model_is_refused_on_every_rank(tmp_path: Path) -> None:
    """FSDP saved on 3 ranks, a wider model loaded on 2: each rank raises, naming the first bad key, before any copy."""
    from axond import nn
    from axond.nn.optim import AdamW
    from axond.parallel import FSDP

    _save_after("fsdp_full", 1, tmp_path / "c", 3)

    def rank(g: ProcessGroup) -> str:
        rng = np.random.default_rng(0)
        wider = FSDP(nn.Sequential(nn.Linear(7, 11, rng=rng), nn.GELU(), nn.LayerNorm(11), nn.Linear(11, 6, rng=rng)), g)
        opt = AdamW(list(wider.parameters()))
        model_sd, optim_sd = ckpt.get_state_dict(wider, opt)
        before = wider.units[0].shard.data.copy()
        with pytest.raises(ckpt.CheckpointError) as info:
            ckpt.load({"model": model_sd, "optim": optim_sd}, tmp_path / "c", g)
        np.testing.assert_array_equal(wider.units[0].shard.data, before)
        return str(info.value)

    for message in run_threads(rank, 2, 60.0):
        assert "'model/3.weight' has shape (5, 11) in the checkpoint, the state to load has (6, 11)" in message
