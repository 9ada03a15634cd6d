"""MixedPrecision under DDP and FSDP against a single-process run with the same dtypes, on thread ranks over
loopback; masters stay float32. GradScaler skips an overflowing step on every rank (DDP, FSDP, ZeRO-1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond import bfloat16
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.optim import SGD, AdamW
from axond.parallel import DDP, FSDP, MixedPrecision, ShardingStrategy, ZeroRedundancyOptimizer
from axond.testing import run_threads

WORLD, ROWS, STEPS = 2, 4, 4
F32 = np.float32
MP = MixedPrecision(param_dtype=bfloat16, reduce_dtype=np.float32)


def run_ranks(fn: Callable[[ProcessGroup], Any], world: int = WORLD) -> list[Any]:
    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


def model(seed: int = 0) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(6, 32, dtype=F32, rng=rng), nn.Tanh(), nn.Linear(32, 32, dtype=F32, rng=rng),
                         nn.LayerNorm(32, dtype=F32), nn.Linear(32, 3, dtype=F32, rng=rng))


def data(step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((rows, 6)).astype(F32), rng.standard_normal((rows, 3)).astype(F32)


def loss_grad(out: np.ndarray, y: np.ndarray, rows: int) -> np.ndarray:
    """d/d out of the mean squared error over `rows` rows (each rank's share of the global mean)."""
    return (2.0 * (out.astype(F32) - y) / (rows * y.shape[1])).astype(out.dtype)


def reference() -> dict[str, np.ndarray]:
    """One process, the same dtypes: float32 masters; for each rank's rows a bfloat16 working copy computes
    forward and backward; the gradients are averaged in float32 (reduce_dtype) and stepped in float32."""
    master = model()
    opt = SGD(list(master.parameters()), lr=0.05)
    for step in range(STEPS):
        x, y = data(step, WORLD * ROWS)
        total = [np.zeros(p.shape, F32) for p in master.parameters()]
        for r in range(WORLD):
            work = model()
            for pw, pm in zip(work.parameters(), master.parameters()):
                pw.data = pm.data.astype(bfloat16)
            mine = slice(r * ROWS, (r + 1) * ROWS)
            work.backward(loss_grad(work(x[mine].astype(bfloat16)), y[mine], ROWS))
            for t, pw in zip(total, work.parameters()):
                t += pw.grad.astype(F32)
        for pm, t in zip(master.parameters(), total):
            pm.grad = t / WORLD
        opt.step()
    return {k: v.copy() for k, v in master.state_dict().items()}


def compute_dtypes(m: nn.Module) -> list[str]:
    """Record the weight dtype every Linear computes with."""
    seen: list[str] = []
    for sub in m.modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_pre_hook(lambda mod, x: seen.append(str(mod.weight.data.dtype)))
    return seen


def train(g: ProcessGroup, wrap: Callable[[nn.Module, ProcessGroup], Any]) -> tuple[Any, ...]:
    inner = model()
    seen = compute_dtypes(inner)
    wrapped = wrap(inner, g)
    opt = SGD(list(wrapped.parameters()), lr=0.05)
    for step in range(STEPS):
        x, y = data(step, WORLD * ROWS)
        mine = slice(g.rank * ROWS, (g.rank + 1) * ROWS)
        opt.zero_grad()
        out = wrapped(x[mine])
        wrapped.backward(loss_grad(out, y[mine], ROWS))
        grads = {str(p.grad.dtype) for p in wrapped.parameters()}
        opt.step()
    masters = {str(p.data.dtype) for p in wrapped.parameters()}
    state = wrapped.state_dict() if isinstance(wrapped, FSDP) else wrapped.module.state_dict()
    return state, set(seen), grads, masters, str(out.dtype)


# Tolerance: the wrappers and the reference round the same float32 values to bfloat16 at the same points, and
# average the same float32 gradients (two terms: (a + b) / 2 in float32 either way); what may differ is float32
# accumulation order inside matmuls of different shapes, a few float32 ulps of the updates. 1e-5 is far below
# a bfloat16 ulp of these weights (~2e-3); measured: 0.0 for DDP and FSDP, while a plain float32 run is
# ~5e-4 away (checked below).
ATOL = 1e-5


@pytest.mark.parametrize("which", ["ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "fsdp-prefetch"])
def test_bfloat16_training_matches_a_single_process_run(which: str) -> None:
    def wrap(m: nn.Module, g: ProcessGroup) -> Any:
        if which == "ddp":
            return DDP(m, g, mixed_precision=MP)
        strategy = {"fsdp-grad-op": ShardingStrategy.SHARD_GRAD_OP,
                    "fsdp-no-shard": ShardingStrategy.NO_SHARD}.get(which, ShardingStrategy.FULL_SHARD)
        prefetch = which == "fsdp-prefetch"  # the reduce-scatter of the cast gradient runs asynchronously
        return FSDP(m, group=g, sharding_strategy=strategy, mixed_precision=MP, forward_prefetch=prefetch,
                    backward_prefetch=prefetch, wrap=lambda sub: isinstance(sub, nn.Linear))

    want = reference()
    for state, seen, grads, masters, out_dtype in run_ranks(lambda g: train(g, wrap)):
        assert seen == {"bfloat16"} and out_dtype == "bfloat16"  # forward ran in param_dtype
        assert grads == {"float32"} and masters == {"float32"}  # the optimizer saw float32 masters and gradients
        for k, v in want.items():
            assert state[k].dtype == F32
            np.testing.assert_allclose(state[k], v, rtol=0, atol=ATOL, err_msg=k)


def test_the_reference_tolerance_tells_bfloat16_from_float32() -> None:
    """The parity tolerance is tight enough that a float32 run would fail it."""
    plain = model()
    opt = SGD(list(plain.parameters()), lr=0.05)
    for step in range(STEPS):
        x, y = data(step, WORLD * ROWS)
        plain.backward(loss_grad(plain(x), y, WORLD * ROWS))
        opt.step()
        opt.zero_grad()
    want = reference()
    worst = max(float(np.abs(plain.state_dict()[k] - v).max()) for k, v in want.items())
    assert worst > ATOL


def test_mixed_precision_is_validated() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        MixedPrecision(param_dtype=np.int32)
    with pytest.raises(TypeError, match="MixedPrecision"):
        DDP(model(), ProcessGroup.mock(), mixed_precision="bf16")  # type: ignore[arg-type]
    assert MixedPrecision(param_dtype="bfloat16").param_dtype == bfloat16


def test_eval_forward_leaves_the_masters_in_place() -> None:
    ddp = DDP(model(), ProcessGroup.mock(), mixed_precision=MP)
    ddp.eval()
    assert ddp(data(0, 2)[0]).dtype == bfloat16
    assert {p.data.dtype for p in ddp.parameters()} == {np.dtype(F32)}


def scaler_run(g: ProcessGroup, kind: str) -> tuple[list[np.ndarray], list[np.ndarray], list[bool], list[float]]:
    """Three steps; on the second, rank 1 alone finds an inf in its gradients."""
    m = model()
    scaler = nn.GradScaler(init_scale=1024.0, growth_interval=1, group=g)
    if kind == "ddp":
        wrapped: Any = DDP(m, g, mixed_precision=MP)
        opt: Any = AdamW(list(wrapped.parameters()), lr=1e-2)
    elif kind == "fsdp":
        wrapped = FSDP(m, group=g, mixed_precision=MP)
        opt = AdamW(list(wrapped.parameters()), lr=1e-2)
    else:
        wrapped = m
        opt = ZeroRedundancyOptimizer(list(m.parameters()), AdamW, group=g, average_gradients=True, lr=1e-2)
    before, stepped, scales = [], [], []
    for step in range(3):
        x, y = data(step, ROWS)
        opt.zero_grad()
        wrapped.backward(scaler.scale(loss_grad(wrapped(x), y, ROWS)))
        if step == 1 and g.rank == 1:
            next(p for p in opt.params if p.grad is not None).grad.reshape(-1)[0] = np.inf
        before.append(np.concatenate([p.data.reshape(-1).astype(F32) for p in wrapped.parameters()]))
        stepped.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
    after = np.concatenate([p.data.reshape(-1).astype(F32) for p in wrapped.parameters()])
    return before + [after], [], stepped, scales


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "zero1"])
def test_a_forced_overflow_skips_the_step_on_every_rank(kind: str) -> None:
    for params, _, stepped, scales in run_ranks(lambda g: scaler_run(g, kind)):
        assert stepped == [True, False, True]
        assert scales == [2048.0, 1024.0, 2048.0]  # grows after each good step (interval 1), halves on overflow
        assert not np.array_equal(params[0], params[1])  # the first step moved the parameters
        np.testing.assert_array_equal(params[1], params[2])  # the skipped step left them unchanged
        assert not np.array_equal(params[2], params[3])


def test_grad_scaler_unscales_before_the_step() -> None:
    m = model()
    opt = SGD(list(m.parameters()), lr=0.0)
    scaler = nn.GradScaler(init_scale=256.0)
    x, y = data(0, ROWS)
    m.backward(loss_grad(m(x), y, ROWS))
    plain = [p.grad.copy() for p in m.parameters()]
    opt.zero_grad()
    m.backward(scaler.scale(loss_grad(m(x), y, ROWS)))
    assert scaler.unscale_(opt) is False
    for p, want in zip(m.parameters(), plain):
        np.testing.assert_allclose(p.grad, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="backoff_factor"):
        nn.GradScaler(backoff_factor=2.0)


def test_fsdp_summons_and_saves_the_float32_masters() -> None:
    def body(g: ProcessGroup) -> tuple[set[str], dict[str, np.ndarray], set[str]]:
        fsdp = FSDP(model(), group=g, mixed_precision=MP)
        with fsdp.summon_full_params():
            managed = [p for u in fsdp.units for p in u.params]
            inside = {str(p.data.dtype) for p in managed}
            for p in managed:
                p.data += np.float32(1e-4)  # below a bfloat16 ulp of these weights: survives only in float32
        state = fsdp.state_dict()
        fsdp(data(0, 2)[0])
        return inside, state, {str(u.full_dtype) for u in fsdp.units}

    want = {k: v + np.float32(1e-4) for k, v in model().state_dict().items() if k.endswith(("weight", "bias"))}
    for inside, state, compute in run_ranks(body):
        assert inside == {"float32"} and compute == {"bfloat16"}
        for k, v in want.items():
            np.testing.assert_array_equal(state[k], v)


def test_grad_scaler_with_a_pipeline_skips_on_every_stage() -> None:
    from axond.parallel import Pipeline

    def body(g: ProcessGroup) -> tuple[list[bool], list[np.ndarray]]:
        scaler = nn.GradScaler(init_scale=256.0, growth_interval=1, group=g)
        pipe = Pipeline(model(), g, loss_fn=scaler.scale_loss(nn.MSELoss()), num_microbatches=2)
        opt = SGD(list(pipe.parameters()), lr=0.05)
        stepped, params = [], []
        for step in range(3):
            x, y = data(step, ROWS)
            pipe.zero_grad()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)
            if step == 1 and g.rank == 0:
                next(iter(pipe.parameters())).grad.reshape(-1)[0] = np.nan
            params.append(np.concatenate([p.data.reshape(-1) for p in pipe.parameters()]))
            stepped.append(scaler.step(opt))
            scaler.update()
        params.append(np.concatenate([p.data.reshape(-1) for p in pipe.parameters()]))
        return stepped, params

    for stepped, params in run_ranks(body):
        assert stepped == [True, False, True]
        np.testing.assert_array_equal(params[1], params[2])
        assert not np.array_equal(params[2], params[3])


def test_buffer_dtype_casts_floating_buffers_only() -> None:
    m = model()
    m.register_buffer("running", np.ones(3, F32))
    m.register_buffer("steps", np.zeros(1, np.int64))
    ddp = DDP(m, ProcessGroup.mock(), mixed_precision=MixedPrecision(buffer_dtype=bfloat16))
    buffers = dict(ddp.module.named_buffers())
    assert buffers["running"].dtype == bfloat16 and buffers["steps"].dtype == np.int64
