"""DistributedTrainer with parallel="tp" and "pipeline": the ranks split the model and read the same batches.

Each run is interrupted at step 5, resumed from its step-4 checkpoint, and must end with the parameters
of a single-process run of the same model on the same batches (float32, other summation order: ~1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond.checkpoint as ckpt
from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.parallel import ColumnParallelLinear, RowParallelLinear
from axond.testing import RankFailed, run_threads
from axond.train import DistributedTrainer
from trainer_cases import X, Y, DieAt


def _model(kind: str, group: ProcessGroup) -> nn.Sequential:
    rng = np.random.default_rng(3)
    if kind == "tp":
        return nn.Sequential(ColumnParallelLinear(6, 8, group=group, rng=rng), nn.Tanh(),
                             RowParallelLinear(8, 3, group=group, rng=rng))
    if kind == "pipeline":
        return nn.Sequential(nn.Linear(6, 8, rng=rng), nn.Tanh(), nn.Linear(8, 8, rng=rng), nn.Tanh(),
                             nn.Linear(8, 3, rng=rng))
    return nn.Sequential(nn.Linear(6, 8, rng=rng), nn.Tanh(), nn.Linear(8, 3, rng=rng))


def _trainer(kind: str, parallel: str, group: ProcessGroup, directory: Path, **options: Any) -> DistributedTrainer:
    extra = {"wrapper_options": {"num_microbatches": 2}} if parallel == "pipeline" else {}
    return DistributedTrainer(_model(kind, group), lambda ps: AdamW(ps, lr=0.02), nn.CrossEntropyLoss(), (X, Y),
                              batch_size=8, parallel=parallel, checkpoint_dir=directory, checkpoint_every=4,
                              group=group, clip_norm=0.5, progress=False, eval_dataset=(X[:16], Y[:16]),
                              **extra, **options)


@pytest.mark.parametrize("kind", ["tp", "pipeline"])
def test_interrupted_run_matches_a_single_process_run(kind: str, tmp_path: Path) -> None:
    def reference(g: ProcessGroup) -> list[dict[str, float]]:
        return _trainer("pipeline" if kind == "pipeline" else "plain", "none", g, tmp_path / "ref").fit(2)

    want_history = run_threads(reference, 1, 60.0)[0]

    def first(g: ProcessGroup) -> None:
        _trainer(kind, kind, g, tmp_path / "ck", callbacks=[DieAt(5, tmp_path, hard=False)]).fit(2)

    with pytest.raises(RankFailed, match="killed at step 5"):
        run_threads(first, 2, 60.0)

    def second(g: ProcessGroup) -> Any:
        t = _trainer(kind, kind, g, tmp_path / "ck")
        return t.fit(2), t.resumed_from

    for history, resumed in run_threads(second, 2, 60.0):
        assert resumed == str(tmp_path / "ck" / "step_000000004")
        np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in want_history], rtol=1e-5)
        np.testing.assert_allclose([h["eval_loss"] for h in history], [h["eval_loss"] for h in want_history], rtol=1e-5)
    got, want = ckpt.load_full(ckpt.latest(tmp_path / "ck")), ckpt.load_full(ckpt.latest(tmp_path / "ref"))
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
