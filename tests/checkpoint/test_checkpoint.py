"""Checkpoint files: round trips, atomic commits, torn and corrupted files, mismatched models, async saves."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import axond.checkpoint as ckpt
from axond import nn
from axond.checkpoint import CheckpointError
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.testing import RankFailed, run_threads
from checkpoint_cases import build, make_model, train

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)  # a dtype NumPy only knows through ml_dtypes
except ImportError:
    BF16 = np.dtype(np.float16)


def _trained(steps: int = 2) -> tuple[nn.Module, AdamW]:
    model, opt = build("plain", None)
    train(model, opt, 0, 1, range(steps))
    return model, opt  # type: ignore[return-value]


def _state(model: nn.Module, opt: AdamW) -> dict:
    model_sd, optim_sd = ckpt.get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def test_round_trip_single_process(tmp_path: Path) -> None:
    """No process group: one rank. Values, optimizer steps and hyper-parameters (a tuple) come back."""
    model, opt = _trained()
    extra = {"bf16": np.arange(6, dtype=BF16).reshape(2, 3), "scalar": np.array(3.5), "step": 7, "name": "x"}
    ckpt.save({**_state(model, opt), "extra": extra}, tmp_path / "c")
    fresh, fresh_opt = build("plain", None)
    sd = _state(fresh, fresh_opt)
    sd["extra"] = {"bf16": np.zeros((2, 3), BF16), "scalar": np.array(0.0), "step": 0, "name": ""}
    ckpt.load(sd, tmp_path / "c")
    ckpt.set_state_dict(fresh, fresh_opt, sd["model"], sd["optim"])
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=k)
    assert [st["step"] for st in fresh_opt.state] == [2] * len(fresh_opt.state)
    assert fresh_opt.defaults["betas"] == (0.9, 0.999) and isinstance(fresh_opt.defaults["betas"], tuple)
    np.testing.assert_array_equal(fresh_opt.state[0]["exp_avg"], opt.state[0]["exp_avg"])
    assert sd["extra"]["bf16"].dtype == BF16 and sd["extra"]["bf16"][1, 2] == 5
    assert float(sd["extra"]["scalar"]) == 3.5 and sd["extra"]["step"] == 7 and sd["extra"]["name"] == "x"
    x = np.ones((2, 7), np.float32)
    np.testing.assert_array_equal(model(x), fresh(x))


def test_a_fresh_optimizer_gets_state_to_load_into(tmp_path: Path) -> None:
    """AdamW before its first step: get_state_dict creates step 0 and zero moments (what the first step makes)."""
    model, opt = build("plain", None)
    _, optim_sd = ckpt.get_state_dict(model, opt)
    assert optim_sd is not None and optim_sd["state"]["0.weight"]["step"] == 0
    train(model, opt, 0, 1, range(1))
    other, other_opt = build("plain", None)
    train(other, other_opt, 0, 1, range(1))
    for a, b in zip(model.parameters(), other.parameters()):
        np.testing.assert_array_equal(a.data, b.data)


def test_load_refuses_a_mismatched_model_naming_the_first_bad_key(tmp_path: Path) -> None:
    model, opt = _trained(1)
    ckpt.save(_state(model, opt), tmp_path / "c")
    rng = np.random.default_rng(0)
    wider = nn.Sequential(nn.Linear(7, 12, rng=rng), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 5, rng=rng))
    with pytest.raises(CheckpointError, match=r"'model/0\.weight' has shape \(11, 7\) in the checkpoint.*\(12, 7\)"):
        ckpt.load(_state(wider, AdamW(list(wider.parameters()))), tmp_path / "c")
    deeper = make_model().append(nn.Linear(5, 5, rng=rng))
    with pytest.raises(CheckpointError, match=r"missing key 'model/4\.weight'"):
        ckpt.load(_state(deeper, AdamW(list(deeper.parameters()))), tmp_path / "c")
    shallow = nn.Sequential(nn.Linear(7, 11, rng=rng))
    with pytest.raises(CheckpointError, match=r"unexpected key 'model/2\.weight'"):
        ckpt.load({"model": ckpt.get_state_dict(shallow)[0]}, tmp_path / "c")
    doubled = make_model().to(dtype=np.float64)
    with pytest.raises(CheckpointError, match=r"'model/0\.weight' has dtype float32 in the checkpoint.*float64"):
        ckpt.load({"model": ckpt.get_state_dict(doubled)[0]}, tmp_path / "c")
    only_model = make_model()
    ckpt.load({"model": ckpt.get_state_dict(only_model)[0]}, tmp_path / "c")  # a section alone is fine
    np.testing.assert_array_equal(only_model.state_dict()["3.bias"], model.state_dict()["3.bias"])


def test_optimizer_state_of_another_sharding_is_refused_up_front() -> None:
    """The old failure: optimizer state saved on 3 ranks loaded on 2 broadcast-failed in AdamW.step."""
    model, opt = _trained(1)
    state = opt.state_dict()
    state["state"]["0.exp_avg"] = state["state"]["0.exp_avg"].reshape(-1)[:30]
    fresh = AdamW(list(make_model().parameters()))
    with pytest.raises(ValueError, match="saved under another sharding.*axond.checkpoint"):
        fresh.load_state_dict(state)
    assert fresh.state == [{} for _ in fresh.params], "nothing is half-loaded"


def _two_checkpoints(root: Path) -> tuple[Path, Path]:
    model, opt = _trained(1)
    old = Path(ckpt.save(_state(model, opt), root / "step_1"))
    train(model, opt, 0, 1, range(1, 2))
    new = Path(ckpt.save(_state(model, opt), root / "step_2"))
    return old, new


def test_latest_skips_torn_and_incomplete_checkpoints(tmp_path: Path) -> None:
    old, new = _two_checkpoints(tmp_path)
    assert ckpt.latest(tmp_path) == str(new)
    (tmp_path / ".step_3.tmp-abc").mkdir()  # a save killed before its commit
    (tmp_path / ".step_3.tmp-abc" / "__0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "step_4").mkdir()  # a directory that never got metadata
    assert ckpt.latest(tmp_path) == str(new)
    data = new / "__0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 10)
    assert ckpt.latest(tmp_path) == str(old), "a torn file disqualifies the newer checkpoint"
    model, opt = build("plain", None)
    with pytest.raises(CheckpointError, match="torn"):
        ckpt.load(_state(model, opt), new)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.load(_state(model, opt), tmp_path / "step_4")
    assert ckpt.latest(tmp_path / "nothing-here") is None


def test_corrupted_bytes_are_caught_by_the_checksums(tmp_path: Path) -> None:
    old, new = _two_checkpoints(tmp_path)
    data = new / "__0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    assert ckpt.latest(tmp_path) == str(new), "same size: only a full verification reads the bytes"
    assert ckpt.latest(tmp_path, verify=True) == str(old)
    model, opt = build("plain", None)
    with pytest.raises(CheckpointError, match="corrupted: the checksum of '.*'"):
        ckpt.load(_state(model, opt), new)


def test_overwriting_a_checkpoint_replaces_it_whole(tmp_path: Path) -> None:
    model, opt = _trained(1)
    ckpt.save(_state(model, opt), tmp_path / "c")
    train(model, opt, 0, 1, range(1, 2))
    ckpt.save(_state(model, opt), tmp_path / "c")
    np.testing.assert_array_equal(ckpt.load_full(tmp_path / "c")["0.weight"], model.state_dict()["0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "no temporary directory is left behind"


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    def rank(g: ProcessGroup) -> None:
        model, opt = build("ddp", g)
        state = _state(model, opt)
        if g.rank == 1:
            state["bad"] = {"thing": object()}
        ckpt.save(state, tmp_path / "c", g)

    with pytest.raises(RankFailed, match="'bad/thing' is a object"):
        run_threads(rank, 2, 30.0)
    assert not (tmp_path / "c").exists()


def test_async_save_equals_save_and_copies_before_returning(tmp_path: Path) -> None:
    def rank(g: ProcessGroup) -> None:
        model, opt = build("fsdp_full", g)
        train(model, opt, g.rank, g.size, range(1))
        ckpt.save(_state(model, opt), tmp_path / "sync", g)
        future = ckpt.async_save(_state(model, opt), tmp_path / "async", g)
        train(model, opt, g.rank, g.size, range(1, 2))  # changes the live arrays while the save writes
        second = ckpt.async_save(_state(model, opt), tmp_path / "async2", g)  # first waits for the first save
        assert future.done()
        assert future.result(timeout=30) == str(tmp_path / "async")
        second.result(timeout=30)

    run_threads(rank, 3, 60.0)
    sync, asynced = ckpt.load_full(tmp_path / "sync", ""), ckpt.load_full(tmp_path / "async", "")
    assert list(sync) == list(asynced)
    for key in sync:
        np.testing.assert_array_equal(sync[key], asynced[key], err_msg=key)
    assert ckpt.read_metadata(tmp_path / "sync").objects == ckpt.read_metadata(tmp_path / "async").objects
    later = ckpt.load_full(tmp_path / "async2")
    assert not np.array_equal(later["0.weight"], asynced["model/0.weight"])
    assert ckpt.latest(tmp_path) == str(tmp_path / "async2")
    assert sorted(os.listdir(tmp_path / "async")) == [".metadata", "__0.distcp", "__1.distcp", "__2.distcp"]


def test_export_writes_one_npz_a_plain_model_loads(tmp_path: Path) -> None:
    def rank(g: ProcessGroup) -> None:
        model, opt = build("fsdp_full", g)
        train(model, opt, g.rank, g.size, range(1))
        ckpt.save(_state(model, opt), tmp_path / "c", g)

    run_threads(rank, 3, 60.0)
    out = ckpt.export(tmp_path / "c", tmp_path / "model.npz")
    plain = make_model()
    with np.load(out) as data:
        plain.load_state_dict({k: data[k] for k in data.files})
    full = ckpt.load_full(tmp_path / "c")
    np.testing.assert_array_equal(plain.state_dict()["3.weight"], full["3.weight"])
    with pytest.raises(CheckpointError, match="no tensors under 'weights'"):
        ckpt.load_full(tmp_path / "c", "weights")
