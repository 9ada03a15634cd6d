"""ZeroRedundancyOptimizer (ZeRO-1) over the real TCP backend, ranks as threads: parity with the plain
optimizer (behind DDP, and reducing gradients itself), the state each rank holds, and the consolidated
state dict, including reloading it on a different number of ranks.

Parity tolerance: float64. With DDP the gradients are bit-for-bit what DDP gives the plain optimizer;
the difference to the single-process reference is the order of the batch sum (a few ulps per step),
and the update of a shard is elementwise, so it is the plain optimizer's to the last bit. After 6
steps of SGD with momentum or AdamW that stays ~1e-14; we assert 1e-9, far below what a wrong shard
offset, a missed all_gather or a double average would cause (training moves parameters > 1e-2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.optim import SGD, AdamW, Optimizer
from axond.parallel.ddp import DDP
from axond.parallel.zero import ZeroRedundancyOptimizer

TOL = 1e-9
STEPS = 6
ROWS = 12
HYPER: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    "adamw": {"lr": 1e-2, "weight_decay": 1e-2},
}
CLASSES: dict[str, type[Optimizer]] = {"sgd": SGD, "adamw": AdamW}


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    from axond.testing import run_threads

    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


def mlp(seed: int) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    f = np.float64
    return nn.Sequential(nn.Linear(6, 16, dtype=f, rng=rng), nn.Tanh(), nn.LayerNorm(16, dtype=f), nn.Linear(16, 3, dtype=f, rng=rng))


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return rng.standard_normal((ROWS, 6)), rng.integers(0, 3, ROWS)


def local_grads(model: nn.Module, step: int, rank: int, world: int) -> None:
    """Forward/backward of this rank's rows of the step's batch into the model's `.grad`."""
    x, y = data(step)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    loss = nn.CrossEntropyLoss()
    model.zero_grad()
    loss(model(x[rows]), y[rows])
    model.backward(loss.backward())


def reference(opt: str, steps: int = STEPS) -> tuple[list[np.ndarray], Optimizer]:
    model = mlp(0)
    optim = CLASSES[opt](list(model.parameters()), **HYPER[opt])
    for step in range(steps):
        local_grads(model, step, 0, 1)
        optim.step()
    return [p.data.copy() for p in model.parameters()], optim


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)


def test_reference_depends_on_the_data() -> None:
    start = [p.data for p in mlp(0).parameters()]
    for opt in HYPER:
        end, _ = reference(opt)
        assert max(float(np.abs(a - b).max()) for a, b in zip(start, end)) > 1e-2


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_behind_ddp_matches_plain_optimizer(world: int, opt: str) -> None:
    want, _ = reference(opt)

    def body(g: ProcessGroup) -> tuple[list[np.ndarray], int, int]:
        model = mlp(0 if g.rank == 0 else 50 + g.rank)
        ddp = DDP(model, g)
        zero = ZeroRedundancyOptimizer(model.parameters(), CLASSES[opt], group=g, **HYPER[opt])
        for step in range(STEPS):
            local_grads(ddp, step, g.rank, g.size)
            zero.step()
        held = sum(v.size for st in zero.optim.state for v in st.values() if hasattr(v, "size"))
        # the parameters live in the buckets' flat buffers: no second copy of them is kept
        flats = [b.flat for b in zero.buckets]
        assert all(any(np.shares_memory(p.data, f) for f in flats) for p in model.parameters())
        return [p.data.copy() for p in model.parameters()], zero.local_numel, held

    total = sum(p.size for p in mlp(0).parameters())
    for params, local, held in run_ranks(world, body):
        assert_close(params, want)
        assert local == math.ceil(total / world)
        assert held == (2 if opt == "adamw" else 1) * local  # state only for this rank's shard


def test_zero_reducing_gradients_itself_matches_plain_optimizer() -> None:
    want, _ = reference("adamw")

    def body(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp(0)
        zero = ZeroRedundancyOptimizer(model.parameters(), group=g, average_gradients=True, **HYPER["adamw"])
        for step in range(STEPS):
            local_grads(model, step, g.rank, g.size)
            zero.step()
        return [p.data.copy() for p in model.parameters()]

    for params in run_ranks(3, body):
        assert_close(params, want)


def test_consolidated_state_dict_reloads_on_another_world_size() -> None:
    """3 steps on 3 ranks, state saved; 3 more on 2 ranks from it: the same as 6 plain steps.
    The consolidated state is also exactly the plain AdamW's state, flattened."""
    want, _ = reference("adamw")
    _, plain3 = reference("adamw", 3)

    def first(g: ProcessGroup) -> tuple[list[np.ndarray], dict[str, Any]]:
        model = mlp(0)
        zero = ZeroRedundancyOptimizer(model.parameters(), group=g, average_gradients=True, **HYPER["adamw"])
        for step in range(3):
            local_grads(model, step, g.rank, g.size)
            zero.step()
        return [p.data.copy() for p in model.parameters()], zero.state_dict()

    saved = run_ranks(3, first)
    params3, state = saved[0]
    for _, other in saved[1:]:
        np.testing.assert_array_equal(other["state"]["0.exp_avg"], state["state"]["0.exp_avg"])
    for key in ("exp_avg", "exp_avg_sq"):
        flat = np.concatenate([st[key].reshape(-1) for st in plain3.state])
        np.testing.assert_allclose(state["state"][f"0.{key}"], flat, rtol=TOL, atol=TOL)
    assert state["state"]["0.step"] == 3

    def second(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp(9)
        for p, v in zip(model.parameters(), params3):
            p.data[...] = v
        zero = ZeroRedundancyOptimizer(model.parameters(), group=g, average_gradients=True, lr=0.5)
        zero.load_state_dict(state)
        assert zero.lr == HYPER["adamw"]["lr"]
        for step in range(3, STEPS):
            local_grads(model, step, g.rank, g.size)
            zero.step()
        return [p.data.copy() for p in model.parameters()]

    for params in run_ranks(2, second):
        assert_close(params, want)


def test_zero_grad_buckets_and_errors() -> None:
    def body(g: ProcessGroup) -> None:
        mixed = nn.Sequential(nn.Linear(3, 4, dtype=np.float32), nn.Linear(4, 2, dtype=np.float64))
        zero = ZeroRedundancyOptimizer(mixed.parameters(), SGD, group=g, lr=0.1)
        assert [b.shard.dtype for b in zero.buckets] == [np.float32, np.float64]
        out = mixed(np.ones((2, 3), np.float32))
        mixed.backward(np.ones_like(out))
        zero.step()
        zero.zero_grad()
        assert all(p.grad is None for p in mixed.parameters())
        assert all(b.shard.grad is None for b in zero.buckets)
        with pytest.raises(TypeError, match="optimizer_class"):
            ZeroRedundancyOptimizer(mixed.parameters(), dict, group=g)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty parameter list"):
            ZeroRedundancyOptimizer([], group=g, lr=0.1)
        other = ZeroRedundancyOptimizer(mlp(0).parameters(), SGD, group=g, lr=0.1)
        with pytest.raises(ValueError, match="same parameters"):
            other.load_state_dict(zero.state_dict())

    run_ranks(2, body)


def test_parameters_replaced_after_wrapping_are_taken_back_into_the_flat_buffer() -> None:
    """`p.data = new_array` (e.g. `module.to(...)`) detaches a parameter from the flat buffer; step() copies it
    back in before updating, so the update starts from the new values and all ranks agree."""

    def body(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp(0)
        zero = ZeroRedundancyOptimizer(model.parameters(), SGD, group=g, lr=0.5)
        first = next(iter(model.parameters()))
        first.data = first.data * 2.0 + 1.0
        for p in model.parameters():
            p.grad = np.ones_like(p.data)
        zero.step()
        assert any(np.shares_memory(first.data, b.flat) for b in zero.buckets)
        return [p.data.copy() for p in model.parameters()]

    want = [p.data - 0.5 for p in mlp(0).parameters()]
    want[0] = next(iter(mlp(0).parameters())).data * 2.0 + 1.0 - 0.5
    for params in run_ranks(2, body):
        assert_close(params, want)
