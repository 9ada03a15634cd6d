"""ParameterServer over the real TCP backend, ranks as threads: sync mode matches DDP on the workers, async
mode matches a single process applying the workers' gradients one at a time in worker order.

Tolerance: float64. Sync mode sums the same per-worker gradients as DDP's all_reduce, in another order
(a tree instead of a ring), so the parameters differ by a few ulps per step; 1e-9 after 5 steps of AdamW
is far below what a missed or doubled gradient, a wrong shard or a stale pull would cause (> 1e-3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.nn.optim import AdamW, Optimizer
from axond.parallel.ddp import DDP
from axond.parallel.fsdp.flat_param import FlatLayout
from axond.parallel.ps import ParameterServer
from axond.testing import run_threads

TOL = 1e-9
STEPS = 5
ROWS = 8


def mlp(seed: int = 0) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    f = np.float64
    return nn.Sequential(nn.Linear(5, 12, dtype=f, rng=rng), nn.Tanh(), nn.Linear(12, 3, dtype=f, rng=rng))


def batch(step: int, worker: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + worker)
    return rng.standard_normal((ROWS, 5)), rng.integers(0, 3, ROWS)


def adamw(params: Iterable[Parameter]) -> Optimizer:
    return AdamW(params, lr=1e-2, weight_decay=1e-2)


def grads(model: nn.Module, step: int, worker: int) -> None:
    x, y = batch(step, worker)
    loss = nn.CrossEntropyLoss()
    model.zero_grad()
    loss(model(x), y)
    model.backward(loss.backward())


def params_of(model: nn.Module) -> list[np.ndarray]:
    return [p.data.copy() for p in model.parameters()]


def run(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_mode_matches_ddp_on_the_workers(servers: int) -> None:
    workers = 2

    def ps_rank(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp()
        ps = ParameterServer(model, adamw, group=g, num_servers=servers)
        if ps.is_server:
            ps.serve(STEPS)
        else:
            for step in range(STEPS):
                grads(model, step, g.rank - servers)
                ps.step()
        return params_of(model)

    def ddp_rank(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp()
        ddp = DDP(model, g)
        opt = adamw(model.parameters())
        loss = nn.CrossEntropyLoss()
        for step in range(STEPS):
            x, y = batch(step, g.rank)
            opt.zero_grad()
            loss(ddp(x), y)
            ddp.backward(loss.backward())
            opt.step()
        return params_of(model)

    got = run(servers + workers, ps_rank)
    want = run(workers, ddp_rank)[0]
    for rank_params in got[servers:]:  # every worker ends with DDP's parameters
        for a, b in zip(rank_params, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    flat_want = np.concatenate([w.ravel() for w in want])
    layout = FlatLayout([w.shape for w in want], servers)
    for s in range(servers):  # each server holds its own shard of them
        lo, hi = layout.shard_range(s)
        hi = min(hi, flat_want.size)
        flat = np.concatenate([a.ravel() for a in got[s]])
        np.testing.assert_allclose(flat[lo:hi], flat_want[lo:hi], rtol=0, atol=TOL)
    assert max(float(np.abs(a - b).max()) for a, b in zip(want, params_of(mlp()))) > 1e-3, "training moved"


def test_async_mode_applies_each_workers_gradient_in_turn() -> None:
    servers, workers = 1, 2

    def ps_rank(g: ProcessGroup) -> list[np.ndarray]:
        model = mlp()
        ps = ParameterServer(model, adamw, group=g, num_servers=servers, mode="async")
        if ps.is_server:
            ps.serve(STEPS)
        else:
            for step in range(STEPS):
                grads(model, step, g.rank - servers)
                ps.step()
        return params_of(model)

    got = run(servers + workers, ps_rank)
    # The reference: one process, the workers' gradients applied one by one in worker order, each on the
    # parameters that worker last pulled (so the second worker's gradient is one update stale).
    model = mlp()
    opt = adamw(model.parameters())
    pulled = [params_of(model) for _ in range(workers)]
    for step in range(STEPS):
        for w in range(workers):
            seen = mlp()
            for p, data in zip(seen.parameters(), pulled[w]):
                p.data[...] = data
            grads(seen, step, w)
            for p, q in zip(model.parameters(), seen.parameters()):
                p.grad = q.grad / workers
            opt.step()
            pulled[w] = params_of(model)
    for a, b in zip(got[0], params_of(model)):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
    for w in range(workers):
        for a, b in zip(got[servers + w], pulled[w]):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOL)


def test_bad_configurations_are_refused() -> None:
    def body(g: ProcessGroup) -> None:
        with pytest.raises(ValueError, match="num_servers"):
            ParameterServer(mlp(), adamw, group=g, num_servers=2)
        with pytest.raises(ValueError, match="mode"):
            ParameterServer(mlp(), adamw, group=g, mode="eventual")  # type: ignore[arg-type]
        ps = ParameterServer(mlp(), adamw, group=g)
        with pytest.raises(RuntimeError, match="serve" if g.rank == 0 else "step"):
            ps.step() if g.rank == 0 else ps.serve(1)

    run(2, body)
