"""DistributedTrainer: training, checkpoints every k steps, and resume that ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond.checkpoint as ckpt
from axond.coordinator.server import RunningCoordinator
from axond.distributed import ProcessGroup
from axond.testing import RankFailed, run_threads
from axond.train import Callback, DistributedTrainer
from trainer_cases import DieAt, final_params, make_trainer

HERE = Path(__file__).resolve().parents[1] / "helpers"


def _run(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    return run_threads(fn, world, 60.0)


def _uninterrupted(epochs: int, **options: Any) -> list[tuple[dict[str, np.ndarray], list[dict[str, float]]]]:
    def rank(g: ProcessGroup) -> Any:
        t = make_trainer(g, None, checkpoint_every=None, **options)
        history = t.fit(epochs)
        return final_params(t), history

    return _run(2, rank)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("parallel,options", [("ddp", {}), ("fsdp", {}), ("zero", {"grad_accum_steps": 2}),
                                              ("ddp", {"async_checkpoint": True})])
def test_resume_after_a_failure_mid_epoch_matches_an_uninterrupted_run(parallel: str, options: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """Checkpoints every 3 steps; the run dies at step 14 (epoch 2, mid-epoch: 9 or 5 steps per epoch) and restarts."""
    epochs, die_at = 3, 14
    expected = _uninterrupted(epochs, parallel=parallel, **options)

    def first(g: ProcessGroup) -> None:
        make_trainer(g, tmp_path / "ck", parallel=parallel, callbacks=[DieAt(die_at, tmp_path, hard=False)],
                     **options).fit(epochs)

    with pytest.raises(RankFailed, match="killed at step 14"):
        _run(2, first)
    assert ckpt.latest(tmp_path / "ck") == str(tmp_path / "ck" / "step_000000012")

    def second(g: ProcessGroup) -> Any:
        t = make_trainer(g, tmp_path / "ck", parallel=parallel, **options)
        history = t.fit(epochs)
        return final_params(t), history, t.resumed_from

    for (params, history, resumed), (want_params, want_history) in zip(_run(2, second), expected):
        assert resumed == str(tmp_path / "ck" / "step_000000012")
        _assert_same(params, want_params)
        assert [h["loss"] for h in history] == [h["loss"] for h in want_history]
    steps_per_epoch = 9 if options.get("grad_accum_steps", 1) == 1 else 5
    final = ckpt.latest(tmp_path / "ck")
    assert final == str(tmp_path / "ck" / f"step_{epochs * steps_per_epoch:09d}")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == Path(final).name
    assert len(list((tmp_path / "ck").iterdir())) == 2, "keep_checkpoints=2 prunes older checkpoints"


def test_a_finished_run_resumes_to_nothing_and_more_epochs_continue(tmp_path: Path) -> None:
    expected = _uninterrupted(3)

    def rank(g: ProcessGroup) -> Any:
        make_trainer(g, tmp_path / "ck").fit(2)
        again = make_trainer(g, tmp_path / "ck")
        assert len(again.fit(2)) == 2 and again.position.global_step == 18
        more = make_trainer(g, tmp_path / "ck")
        return final_params(more) if more.fit(3) else None

    for got, (want, _) in zip(_run(2, rank), expected):
        _assert_same(got, want)


class Record(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs: list[dict[str, float]] = []

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        self.steps.append(int(metrics["global_step"]))

    def on_epoch_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        metrics["custom"] = 1.5
        self.epochs.append(dict(metrics))


class Indexed:
    """A data set object: __len__ and __getitem__(index array) -> (x, y)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[idx], self.y[idx]


def test_callbacks_eval_and_the_epoch_line(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_cases import X, Y

    recorders = [Record(), Record()]

    def rank(g: ProcessGroup) -> Any:
        t = make_trainer(g, None, checkpoint_every=None, callbacks=[recorders[g.rank]], eval_dataset=Indexed(X[:20], Y[:20]),
                         progress=True, log_every=100)
        return t.fit(2)

    histories = _run(2, rank)
    strip = [[{k: v for k, v in h.items() if k != "samples_per_s"} for h in hs] for hs in histories]
    assert strip[0] == strip[1], "the epoch metrics are global (all-reduced), the rate is each rank's view"
    assert [h["epoch"] for h in histories[0]] == [1, 2]
    assert all(h["eval_loss"] > 0 and h["custom"] == 1.5 and h["samples_per_s"] > 0 for h in histories[0])
    assert recorders[0].steps == list(range(1, 19))
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and lines[0].startswith("epoch 1/2 loss ") and " eval_loss " in lines[0], out.out
    assert "custom 1.5000" in lines[1] and "samples/s" in lines[1]
    assert "epoch 2/2 step 9/9 loss" in out.err, "the periodic progress line (not a terminal)"


def test_bad_arguments_are_refused() -> None:
    def rank(g: ProcessGroup) -> None:
        with pytest.raises(ValueError, match="parallel must be one of"):
            make_trainer(g, None, parallel="zero3")
        with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
            make_trainer(g, None, checkpoint_every=2)
        with pytest.raises(ValueError, match="X has 3 rows but y has 2"):
            DistributedTrainer(make_trainer(g, None, checkpoint_every=None).module, list, None,
                               (np.zeros((3, 6)), np.zeros(2)), batch_size=1, group=g)

    _run(2, rank)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_worker_run_restarts_and_ends_like_an_uninterrupted_run(
        coordinator_factory: Callable[..., RunningCoordinator], tmp_path: Path) -> None:
    """`axond worker --max-restarts 1`: both ranks os._exit at step 14 on the first attempt; generation 2 resumes
    from the step-12 checkpoint and its final parameters equal an uninterrupted run's, bit for bit."""
    coord = coordinator_factory(token="T")
    cmd = [sys.executable, "-c", "from axond.cli.main import main; main()", "worker", "--coordinator", coord.address,
           "--token", "T", "--job", "resume", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--",
           sys.executable, str(HERE / "trainer_kill_script.py"), str(tmp_path / "ck"), str(tmp_path), "14", "ddp", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert sorted(p.name for p in tmp_path.glob("died.*")) == ["died.0", "died.1"], "the first attempt died"
    assert "generation 2" in err, err
    assert f"resumed from {tmp_path / 'ck' / 'step_000000012'}" in out, out
    final = ckpt.load_full(ckpt.latest(tmp_path / "ck"))
    _assert_same(final, _uninterrupted(3)[0][0])


@pytest.mark.slow
def test_train_mlp_checkpoint_flags_resume(tmp_path: Path) -> None:
    """The example's --checkpoint-dir/--checkpoint-every: a second run with more epochs resumes from the first."""
    from axond.testing import run_processes

    args = ["--samples", "256", "--checkpoint", "", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3"]
    assert run_processes("axond.examples.train_mlp", 2, timeout=100, args=["--epochs", "1", *args]) == [0, 0]
    assert ckpt.latest(tmp_path / "ck") == str(tmp_path / "ck" / "step_000000002"), "2 steps per epoch, then the end"
    assert run_processes("axond.examples.train_mlp", 2, timeout=100, args=["--epochs", "3", *args]) == [0, 0]
    meta = ckpt.read_metadata(ckpt.latest(tmp_path / "ck"))
    assert (meta.objects["trainer/epoch"], meta.objects["trainer/global_step"]) == (3, 6)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_000000003", "step_000000006"]
