"""PowerSGD as a DDP communication hook: the result is its definition (checked against NumPy on the stacked inputs),
error feedback and warm start carry over steps, exact parts stay exact, ranks agree bitwise, and training
converges."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.parallel import DDP
from axond.parallel.ddp import GradBucket, PowerSGDState, powerSGD_hook
from axond.testing import run_threads

WORLD = 2
SHAPES = [(48, 40), (40,), (6, 5)]
"""A matrix worth compressing at rank 2 ((48 + 40) 2 x 2 < 48 x 40), a vector, and one too small to gain."""


def grads_of(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng([rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def bucket_of(g: ProcessGroup, grads: list[np.ndarray], params: list[Parameter]) -> GradBucket:
    flat = np.concatenate([x.reshape(-1) for x in grads] + [np.ones(len(grads), np.float32)])
    return GradBucket(0, flat, params, True, g)


def hook_steps(g: ProcessGroup, state_kwargs: dict[str, Any], steps: int) -> list[np.ndarray]:
    params = [Parameter(np.zeros(s, np.float32)) for s in SHAPES]
    state = PowerSGDState(g, **state_kwargs)
    out = []
    for step in range(steps):
        reduced = powerSGD_hook(state, bucket_of(g, grads_of(g.rank, step), params)).wait(20.0)
        out.append(np.array(reduced))
    return out


def reference(steps: int, rank_r: int, feedback: bool, warm: bool) -> list[np.ndarray]:
    """The definition on the stacked inputs of every rank: P = sum M Q, orthonormalized; Q = mean M^T P; P Q^T."""
    rng = np.random.default_rng(0)
    q = None
    errors = [np.zeros(SHAPES[0], np.float32) for _ in range(WORLD)]
    out = []
    for step in range(steps):
        inputs = [grads_of(r, step) for r in range(WORLD)]
        mats = [inputs[r][0] + errors[r] for r in range(WORLD)]
        if q is None or not warm:
            q = rng.standard_normal((SHAPES[0][1], rank_r)).astype(np.float32)
        p = np.linalg.qr(sum(m @ q for m in mats))[0]
        q = sum(m.T @ p for m in mats) / WORLD
        approx = p @ q.T
        if feedback:
            errors = [m - approx for m in mats]
        exact = [sum(inputs[r][i] for r in range(WORLD)) / WORLD for i in (1, 2)]
        out.append(np.concatenate([approx.reshape(-1), exact[0], exact[1].reshape(-1), np.ones(3, np.float32)]))
    return out


@pytest.mark.parametrize("feedback, warm", [(True, True), (False, True), (True, False)])
def test_the_hook_computes_its_definition(feedback: bool, warm: bool) -> None:
    kwargs = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0, "use_error_feedback": feedback,
              "warm_start": warm}
    got = run_threads(lambda g: hook_steps(g, kwargs, 3), WORLD, 60.0, options=BackendOptions(timeout=20))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got[0], got[1]))  # every rank the same bits
    for step, (mine, want) in enumerate(zip(got[0], reference(3, 2, feedback, warm))):
        np.testing.assert_allclose(mine, want, rtol=2e-4, atol=2e-5, err_msg=f"step {step}")
    exact = got[0][0][48 * 40 :]
    stacked = [grads_of(r, 0) for r in range(WORLD)]
    assert np.array_equal(exact[:40], (stacked[0][1] + stacked[1][1]) / 2)  # the vector: averaged exactly


def test_the_first_steps_are_plain_averages_and_steps_count_at_the_last_bucket() -> None:
    def body(g: ProcessGroup) -> tuple[np.ndarray, int]:
        state = PowerSGDState(g, start_powerSGD_iter=1)
        params = [Parameter(np.zeros(s, np.float32)) for s in SHAPES]
        first = GradBucket(0, bucket_of(g, grads_of(g.rank, 0), params).buffer(), params, False, g)
        reduced = powerSGD_hook(state, first).wait(20.0)
        assert state.iter == 0  # not the step's last bucket
        powerSGD_hook(state, bucket_of(g, grads_of(g.rank, 0), params)).wait(20.0)
        return np.array(reduced), state.iter
    got = run_threads(body, WORLD, 60.0, options=BackendOptions(timeout=20))
    want = sum(np.concatenate([x.reshape(-1) for x in grads_of(r, 0)]) for r in range(WORLD)) / WORLD
    np.testing.assert_allclose(got[0][0][: want.size], want, rtol=1e-6)
    assert [it for _, it in got] == [1, 1]


def test_settings_are_checked() -> None:
    for bad in ({"matrix_approximation_rank": 0}, {"start_powerSGD_iter": -1}, {"min_compression_rate": 0.5}):
        with pytest.raises(ValueError):
            PowerSGDState(None, **bad)


def train(g: ProcessGroup, hook: bool) -> tuple[float, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(32, 64, dtype=np.float32, rng=rng), nn.Tanh(),
                          nn.Linear(64, 8, dtype=np.float32, rng=rng))
    ddp = DDP(model, g)
    if hook:
        ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=5), powerSGD_hook)
    opt = nn.optim.SGD(ddp.parameters(), lr=0.3)
    data = np.random.default_rng(42)
    w = data.standard_normal((32, 8)).astype(np.float32)
    loss = 0.0
    for step in range(80):
        x = np.random.default_rng([g.rank, step]).standard_normal((16, 32)).astype(np.float32)
        y = np.tanh(x @ w)
        out = ddp(x)
        loss = float(((out - y) ** 2).mean())
        opt.zero_grad()
        ddp.backward(2 * (out - y) / out.size)
        opt.step()
    return loss, [p.data.copy() for p in ddp.parameters()]


def test_training_with_powersgd_converges_like_plain_ddp() -> None:
    """Rank 2 on a 32-64-8 MLP: the loss falls as with exact averages (within 1.5x after 80 steps), and every rank
    keeps the same parameters."""
    plain = run_threads(lambda g: train(g, False), WORLD, 120.0, options=BackendOptions(timeout=20))
    compressed = run_threads(lambda g: train(g, True), WORLD, 120.0, options=BackendOptions(timeout=20))
    start = run_threads(lambda g: train_loss_at_start(g), WORLD, 60.0, options=BackendOptions(timeout=20))[0]
    assert compressed[0][0] < 0.5 * start and compressed[0][0] < 1.5 * plain[0][0], (start, plain[0][0], compressed[0][0])
    for a, b in zip(compressed[0][1], compressed[1][1]):
        assert a.tobytes() == b.tobytes()


def train_loss_at_start(g: ProcessGroup) -> float:
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(32, 64, dtype=np.float32, rng=rng), nn.Tanh(),
                          nn.Linear(64, 8, dtype=np.float32, rng=rng))
    w = np.random.default_rng(42).standard_normal((32, 8)).astype(np.float32)
    x = np.random.default_rng([g.rank, 0]).standard_normal((16, 32)).astype(np.float32)
    return float(((model(x) - np.tanh(x @ w)) ** 2).mean())
