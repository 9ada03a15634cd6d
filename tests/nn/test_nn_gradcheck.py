"""Every layer's backward against central finite differences in float64.

Tolerance: central differences with h = 1e-6 have truncation error O(h^2 * f''') ~ 1e-12 and
rounding error ~ eps * |f| / h ~ 1e-10 for these O(1) functions, so 1e-6 relative + 1e-7 absolute
leaves two orders of margin while catching any wrong term (those are O(1)).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import axond.nn as nn

F64 = np.float64


def numeric_grad(f: Callable[[], float], arr: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(arr)
    flat = arr.reshape(-1)
    gflat = grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        fp = f()
        flat[i] = old - h
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * h)
    return grad


def check_module(module: nn.Module, x: np.ndarray, seed: int = 0, before_forward: Callable[[], None] = lambda: None) -> None:
    rng = np.random.default_rng(seed)
    before_forward()
    upstream = rng.standard_normal(module(x).shape)

    def objective() -> float:
        before_forward()
        return float((module(x) * upstream).sum())

    module.zero_grad()
    before_forward()
    module(x)
    dx = module.backward(upstream)
    if x.dtype.kind == "f":
        np.testing.assert_allclose(dx, numeric_grad(objective, x), rtol=1e-6, atol=1e-7, err_msg="input gradient")
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        np.testing.assert_allclose(p.grad, numeric_grad(objective, p.data), rtol=1e-6, atol=1e-7, err_msg=name)


def rng(seed: int = 1) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_linear_2d_and_3d() -> None:
    check_module(nn.Linear(5, 4, dtype=F64, rng=rng()), rng(2).standard_normal((3, 5)))
    check_module(nn.Linear(5, 4, dtype=F64, rng=rng()), rng(3).standard_normal((2, 3, 5)))
    check_module(nn.Linear(5, 4, bias=False, dtype=F64, rng=rng()), rng(4).standard_normal((3, 5)))


def test_embedding() -> None:
    emb = nn.Embedding(7, 3, dtype=F64, rng=rng())
    idx = np.array([[0, 3, 3], [6, 0, 1]])
    check_module(emb, idx)
    np.testing.assert_allclose(emb(idx), emb.weight.data[idx])


@pytest.mark.parametrize("affine", [True, False])
def test_layernorm(affine: bool) -> None:
    ln = nn.LayerNorm(6, elementwise_affine=affine, dtype=F64)
    if affine:
        ln.weight.data[:] = rng(5).standard_normal(6)
        ln.bias.data[:] = rng(6).standard_normal(6)
    check_module(ln, rng(7).standard_normal((2, 3, 6)) * 3 + 1)


@pytest.mark.parametrize("layer", [nn.ReLU, nn.GELU, nn.Tanh])
def test_activations(layer: type[nn.Module]) -> None:
    x = rng(8).standard_normal((4, 5))
    x[np.abs(x) < 1e-3] = 0.5  # keep ReLU away from its kink, where the derivative is undefined
    check_module(layer(), x)


def test_dropout_train_and_eval() -> None:
    drop = nn.Dropout(0.4, seed=3)
    x = rng(9).standard_normal((6, 5))
    check_module(drop, x, before_forward=lambda: drop.reseed(3))
    drop.reseed(3)
    y = drop(x)
    zeros = (y == 0).mean()
    assert 0.1 < zeros < 0.7
    np.testing.assert_allclose(y[y != 0], x[y != 0] / 0.6)
    drop.eval()
    np.testing.assert_array_equal(drop(x), x)
    np.testing.assert_array_equal(drop.backward(x), x)


def test_dropout_is_seeded() -> None:
    x = np.ones((50, 4))
    a, b = nn.Dropout(0.5, seed=11), nn.Dropout(0.5, seed=11)
    np.testing.assert_array_equal(a(x), b(x))
    assert not np.array_equal(a(x), nn.Dropout(0.5, seed=12)(x))


def test_sequential() -> None:
    model = nn.Sequential(nn.Linear(4, 6, dtype=F64, rng=rng()), nn.Tanh(), nn.Linear(6, 3, dtype=F64, rng=rng()), nn.GELU())
    check_module(model, rng(10).standard_normal((5, 4)))


def test_causal_self_attention() -> None:
    attn = nn.CausalSelfAttention(8, 2, dtype=F64, rng=rng())
    check_module(attn, rng(11).standard_normal((2, 4, 8)))


def test_attention_is_causal() -> None:
    attn = nn.CausalSelfAttention(8, 2, dtype=F64, rng=rng())
    x = rng(12).standard_normal((1, 5, 8))
    y = attn(x)
    x2 = x.copy()
    x2[:, 3:] += 10.0
    np.testing.assert_allclose(attn(x2)[:, :3], y[:, :3], rtol=1e-12, atol=1e-12)


def test_transformer_block() -> None:
    block = nn.TransformerBlock(8, 2, mlp_ratio=2, dtype=F64, rng=rng())
    for name, p in block.named_parameters():
        if name.startswith("ln"):
            p.data += rng(13).standard_normal(p.shape) * 0.1
    check_module(block, rng(14).standard_normal((2, 3, 8)))


def test_transformer_block_with_dropout() -> None:
    block = nn.TransformerBlock(8, 2, mlp_ratio=2, dropout=0.2, dtype=F64, rng=rng(), seed=4)

    def reseed() -> None:
        block.drop1.reseed(4)
        block.drop2.reseed(5)

    check_module(block, rng(15).standard_normal((2, 3, 8)), before_forward=reseed)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_loss(reduction: str) -> None:
    loss = nn.MSELoss(reduction)  # type: ignore[arg-type]
    pred, target = rng(16).standard_normal((4, 3)), rng(17).standard_normal((4, 3))
    value = loss(pred, target)
    expected = ((pred - target) ** 2).mean() if reduction == "mean" else ((pred - target) ** 2).sum()
    assert value == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(loss.backward(), numeric_grad(lambda: loss(pred, target), pred), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy(reduction: str, smoothing: float) -> None:
    loss = nn.CrossEntropyLoss(reduction, ignore_index=-1, label_smoothing=smoothing)  # type: ignore[arg-type]
    logits = rng(18).standard_normal((2, 3, 5))
    target = np.array([[0, 4, -1], [2, 2, 1]])
    loss(logits, target)
    grad = loss.backward()
    np.testing.assert_allclose(grad, numeric_grad(lambda: loss(logits, target), logits), rtol=1e-6, atol=1e-8)
    assert np.all(grad[0, 2] == 0)


def test_cross_entropy_is_stable_and_matches_definition() -> None:
    loss = nn.CrossEntropyLoss()
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 1.0, 2.0]])
    value = loss(logits, np.array([0, 2]))
    row2 = -np.log(np.exp(2.0) / np.exp([0.0, 1.0, 2.0]).sum())
    assert np.isfinite(value)
    assert value == pytest.approx((0.0 + row2) / 2, rel=1e-12)


def test_loss_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="targets of shape"):
        nn.CrossEntropyLoss()(np.zeros((3, 4)), np.zeros(2, dtype=int))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        nn.CrossEntropyLoss()(np.zeros((3, 4)), np.array([0, 1, 4]))
    with pytest.raises(ValueError, match="shape"):
        nn.MSELoss()(np.zeros(3), np.zeros(4))
    with pytest.raises(RuntimeError, match="before the loss"):
        nn.MSELoss().backward()
