"""Optimizers and clipping: torch's update rules, checked against torch when it is installed and
against the written-out formulas otherwise; plus convergence on a quadratic.

Tolerance 1e-12 in float64: the same arithmetic in a possibly different order; 10 steps keep the
accumulated rounding near 1e-15.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import axond.nn as nn
from axond.nn.optim import SGD, AdamW
from axond.nn.utils import clip_grad_norm_


def params(seed: int = 0) -> list[nn.Parameter]:
    rng = np.random.default_rng(seed)
    return [nn.Parameter(rng.standard_normal((3, 4))), nn.Parameter(rng.standard_normal(5))]


def grads(step: int, ps: list[nn.Parameter]) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal(p.shape) for p in ps]


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=0.1),
]
ADAMW_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, amsgrad=True),
]


def reference_sgd(ps: list[np.ndarray], steps: int, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                  weight_decay: float = 0.0, nesterov: bool = False) -> list[np.ndarray]:
    ps = [p.copy() for p in ps]
    bufs: list[np.ndarray | None] = [None] * len(ps)
    for t in range(steps):
        for i, g in enumerate(grads(t, [nn.Parameter(p) for p in ps])):
            d = g + weight_decay * ps[i]
            if momentum:
                bufs[i] = d.copy() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * d
                d = d + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lr * d
    return ps


def reference_adamw(ps: list[np.ndarray], steps: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False) -> list[np.ndarray]:
    ps = [p.copy() for p in ps]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    vmax = [np.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        for i, g in enumerate(grads(t - 1, [nn.Parameter(p) for p in ps])):
            ps[i] = ps[i] * (1 - lr * weight_decay)
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            vmax[i] = np.maximum(vmax[i], v[i])
            vv = vmax[i] if amsgrad else v[i]
            mhat = m[i] / (1 - betas[0] ** t)
            ps[i] = ps[i] - lr * mhat / (np.sqrt(vv) / math.sqrt(1 - betas[1] ** t) + eps)
    return ps


def run(opt_cls: type, kwargs: dict, steps: int = 10) -> list[np.ndarray]:
    ps = params()
    opt = opt_cls(ps, **kwargs)
    for t in range(steps):
        for p, g in zip(ps, grads(t, ps)):
            p.grad = g
        opt.step()
    return [p.data for p in ps]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_reference(kwargs: dict) -> None:
    for a, b in zip(run(SGD, kwargs), reference_sgd([p.data for p in params()], 10, **kwargs)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs", ADAMW_CASES)
def test_adamw_matches_reference(kwargs: dict) -> None:
    for a, b in zip(run(AdamW, kwargs), reference_adamw([p.data for p in params()], 10, **kwargs)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize(("opt_cls", "kwargs"), [(SGD, k) for k in SGD_CASES] + [(AdamW, k) for k in ADAMW_CASES])
def test_matches_torch(opt_cls: type, kwargs: dict) -> None:
    torch = pytest.importorskip("torch")
    tps = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for p in params()]
    topt = getattr(torch.optim, opt_cls.__name__)(tps, **kwargs)
    for t in range(10):
        for p, g in zip(tps, grads(t, params())):
            p.grad = torch.from_numpy(g)
        topt.step()
    for a, b in zip(run(opt_cls, kwargs), tps):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("opt_cls", "kwargs"), [(SGD, dict(lr=0.1, momentum=0.9)), (AdamW, dict(lr=0.1, weight_decay=0.0))])
def test_converges_on_quadratic(opt_cls: type, kwargs: dict) -> None:
    target = np.arange(6.0)
    p = nn.Parameter(np.zeros(6))
    opt = opt_cls([p], **kwargs)
    for _ in range(300):
        p.grad = 2 * (p.data - target)
        opt.step()
    np.testing.assert_allclose(p.data, target, atol=1e-3)


def test_optimizer_state_dict_roundtrip() -> None:
    ps = params()
    opt = AdamW(ps, lr=0.01)
    for p, g in zip(ps, grads(0, ps)):
        p.grad = g
    opt.step()
    ps2 = [nn.Parameter(p.data.copy()) for p in ps]
    opt2 = AdamW(ps2, lr=0.5)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.lr == 0.01
    for q, p, g in zip(ps2, ps, grads(1, ps)):
        p.grad = g
        q.grad = g.copy()
    opt.step()
    opt2.step()
    for p, q in zip(ps, ps2):
        np.testing.assert_array_equal(p.data, q.data)


def test_optimizer_skips_parameters_without_grad_and_rejects_bad_args() -> None:
    ps = params()
    before = ps[1].data.copy()
    ps[0].grad = np.ones(ps[0].shape)
    SGD(ps, lr=0.1).step()
    np.testing.assert_array_equal(ps[1].data, before)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(ps, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="empty"):
        AdamW([])
    with pytest.raises(ValueError, match="betas"):
        AdamW(ps, betas=(1.0, 0.9))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm(norm_type: float) -> None:
    ps = params()
    gs = grads(0, ps)
    for p, g in zip(ps, gs):
        p.grad = g.copy()
    flat = np.concatenate([g.ravel() for g in gs])
    expected = np.abs(flat).max() if norm_type == math.inf else np.linalg.norm(flat, ord=norm_type)
    total = clip_grad_norm_(ps, 0.5, norm_type)
    assert total == pytest.approx(expected, rel=1e-12)
    after = np.concatenate([p.grad.ravel() for p in ps])
    new_norm = np.abs(after).max() if norm_type == math.inf else np.linalg.norm(after, ord=norm_type)
    assert new_norm == pytest.approx(0.5, rel=1e-5)
    assert clip_grad_norm_(ps, 10.0, norm_type) == pytest.approx(new_norm, rel=1e-12)
    ps[0].grad[0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="error_if_nonfinite"):
        clip_grad_norm_(ps, 1.0, norm_type, error_if_nonfinite=True)
