"""Tensor-parallel slices and pipeline stages as shards of the unwrapped model's tensors.

A tensor-parallel MLP saved over 2 ranks resumes over 4 (and the pipeline over 2 stages resumes
over 3), continuing exactly as single-process AdamW on the full model would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import axond.checkpoint as ckpt
from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.parallel import ParallelMLP, Pipeline
from axond.testing import run_threads

X = np.random.default_rng(7).standard_normal((24, 8)).astype(np.float32)
T = np.random.default_rng(8).standard_normal((24, 8)).astype(np.float32)
Y = np.random.default_rng(9).integers(0, 4, 24)


def _mlp_steps(model: nn.Module, opt: AdamW, steps: range) -> None:
    loss = nn.MSELoss()
    for s in steps:
        rows = slice(8 * s, 8 * s + 8)
        opt.zero_grad()
        loss(model(X[rows]), T[rows])
        model.backward(loss.backward())
        opt.step()


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _state(model: Any, opt: AdamW) -> dict[str, Any]:
    model_sd, optim_sd = ckpt.get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _resume(model: Any, opt: AdamW, path: Path, g: ProcessGroup) -> None:
    sd = _state(model, opt)
    ckpt.load(sd, path, g)
    ckpt.set_state_dict(model, opt, sd["model"], sd["optim"])


def test_tensor_parallel_saved_at_2_resumes_at_4(tmp_path: Path) -> None:
    full = nn.MLP(8, 16, rng=np.random.default_rng(0))
    full_opt = AdamW(list(full.parameters()), lr=0.01)
    _mlp_steps(full, full_opt, range(2))
    after_two = {k: v.copy() for k, v in full.state_dict().items()}
    _mlp_steps(full, full_opt, range(2, 3))

    def save(g: ProcessGroup) -> None:
        tp = ParallelMLP(8, 16, g, rng=np.random.default_rng(0))
        opt = AdamW(list(tp.parameters()), lr=0.01)
        _mlp_steps(tp, opt, range(2))
        model_sd, _ = ckpt.get_state_dict(tp, opt)
        assert isinstance(model_sd["fc1.weight"], ckpt.ShardedTensor) and model_sd["fc1.weight"].global_shape == (16, 8)
        ckpt.save(_state(tp, opt), tmp_path / "c", g)

    run_threads(save, 2, 60.0)
    _close(ckpt.load_full(tmp_path / "c"), after_two)

    def resume(g: ProcessGroup) -> dict[str, np.ndarray]:
        tp = ParallelMLP(8, 16, g, rng=np.random.default_rng(1))
        opt = AdamW(list(tp.parameters()), lr=0.01)
        _resume(tp, opt, tmp_path / "c", g)
        _mlp_steps(tp, opt, range(2, 3))
        return {"fc1.weight": tp.fc1.to_linear().weight.data, "fc2.weight": tp.fc2.to_linear().weight.data}

    got = run_threads(resume, 4, 60.0)[0]
    _close(got, {k: full.state_dict()[k] for k in got})


def test_pipeline_saved_over_2_stages_resumes_over_3(tmp_path: Path) -> None:
    def model() -> nn.Sequential:
        rng = np.random.default_rng(4)
        return nn.Sequential(nn.Linear(8, 12, rng=rng), nn.Tanh(), nn.Linear(12, 12, rng=rng), nn.Tanh(),
                             nn.Linear(12, 4, rng=rng))

    def steps(pipe: Pipeline, opt: AdamW, which: range) -> None:
        for s in which:
            rows = slice(8 * s, 8 * s + 8)
            opt.zero_grad()
            pipe.step(X[rows], Y[rows])
            opt.step()

    reference = model()
    ref_opt = AdamW(list(reference.parameters()), lr=0.01)
    loss = nn.CrossEntropyLoss()
    for s in range(3):
        ref_opt.zero_grad()
        loss(reference(X[8 * s : 8 * s + 8]), Y[8 * s : 8 * s + 8])
        reference.backward(loss.backward())
        ref_opt.step()

    def save(g: ProcessGroup) -> None:
        pipe = Pipeline(model(), g, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())
        opt = AdamW(list(pipe.parameters()), lr=0.01)
        steps(pipe, opt, range(2))
        ckpt.save(_state(pipe, opt), tmp_path / "c", g)

    run_threads(save, 2, 60.0)

    def resume(g: ProcessGroup) -> None:
        pipe = Pipeline(model(), g, num_microbatches=2, loss_fn=nn.CrossEntropyLoss())
        opt = AdamW(list(pipe.parameters()), lr=0.01)
        _resume(pipe, opt, tmp_path / "c", g)
        steps(pipe, opt, range(2, 3))
        ckpt.save({"model": ckpt.get_state_dict(pipe)[0]}, tmp_path / "out", g)

    run_threads(resume, 3, 60.0)
    _close(ckpt.load_full(tmp_path / "out"), reference.state_dict())
