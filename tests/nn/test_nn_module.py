"""Module bookkeeping: registration, state_dict round trips, modes, hooks, devices, init determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import axond.nn as nn
from axond.errors import BackendUnavailable
from axond.nn.utils import load_checkpoint, save_checkpoint


def mlp(seed: int = 0, dtype: type = np.float64) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(3, 4, dtype=dtype, rng=rng), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 2, dtype=dtype, rng=rng))


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, dtype=np.float64, rng=np.random.default_rng(0))
        self.register_buffer("running", np.zeros(2))
        self.register_buffer("scratch", np.ones(2), persistent=False)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.lin(x)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.lin.backward(grad_out)


def test_named_parameters_and_state_dict() -> None:
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert model[0].weight.shape == (4, 3)
    assert list(model.state_dict()) == names
    m = WithBuffer()
    assert list(m.state_dict()) == ["running", "lin.weight", "lin.bias"]  # own entries first, as torch
    assert [n for n, _ in m.named_buffers()] == ["running", "scratch"]
    m.running = np.full(2, 7.0)
    assert m.state_dict()["running"][0] == 7.0


def test_reassigning_attributes_updates_the_registry() -> None:
    lin = nn.Linear(2, 2, bias=False)
    assert lin.bias is None and [n for n, _ in lin.named_parameters()] == ["weight"]
    lin.bias = nn.Parameter(np.zeros(2, dtype=np.float32))
    assert isinstance(lin.bias, nn.Parameter) and [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    lin.bias = None
    assert lin.bias is None and [n for n, _ in lin.named_parameters()] == ["weight"]


def test_shared_parameter_listed_once() -> None:
    a = nn.Linear(2, 2)
    b = nn.Linear(2, 2)
    b.weight = a.weight
    assert len(list(nn.Sequential(a, b).parameters())) == 3


def test_load_state_dict_roundtrip_and_errors() -> None:
    src, dst = mlp(1), mlp(2)
    dst.load_state_dict({k: v.copy() for k, v in src.state_dict().items()})
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(KeyError, match="missing keys"):
        dst.load_state_dict({"0.weight": np.zeros((4, 3))})
    missing, unexpected = dst.load_state_dict({"0.weight": np.zeros((4, 3)), "x": np.zeros(1)}, strict=False)
    assert "0.bias" in missing and unexpected == ["x"]
    with pytest.raises(ValueError, match="shape"):
        dst.load_state_dict({**src.state_dict(), "0.weight": np.zeros((3, 3))})


def test_checkpoint_file_roundtrip(tmp_path: Path) -> None:
    src = mlp(3)
    save_checkpoint(tmp_path / "ck" / "model.npz", src.state_dict())
    dst = mlp(4)
    dst.load_state_dict(load_checkpoint(tmp_path / "ck" / "model.npz"))
    x = np.random.default_rng(0).standard_normal((2, 3))
    np.testing.assert_array_equal(src.eval()(x), dst.eval()(x))


def test_init_is_deterministic_from_seed() -> None:
    a, b, c = mlp(5), mlp(5), mlp(6)
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), b.parameters()))
    assert not np.array_equal(a[0].weight.data, c[0].weight.data)
    nn.init.manual_seed(9)
    d = nn.Linear(3, 3)
    nn.init.manual_seed(9)
    e = nn.Linear(3, 3)
    np.testing.assert_array_equal(d.weight.data, e.weight.data)
    assert d.weight.dtype == np.float32
    bound = 1 / np.sqrt(3)
    assert np.all(np.abs(d.weight.data) <= bound)


def test_train_eval_and_zero_grad() -> None:
    model = mlp()
    assert model.training and model[2].training
    model.eval()
    assert not model[2].training
    x = np.ones((8, 3))
    np.testing.assert_array_equal(model(x), model(x))
    model.train()
    model(x)
    model.backward(np.ones((8, 2)))
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_backward_accumulates() -> None:
    model = mlp().eval()
    x = np.random.default_rng(0).standard_normal((5, 3))
    model(x)
    model.backward(np.ones((5, 2)))
    once = [p.grad.copy() for p in model.parameters()]
    model(x)
    model.backward(np.ones((5, 2)))
    for g1, p in zip(once, model.parameters()):
        np.testing.assert_allclose(p.grad, 2 * g1)


def test_backward_without_forward_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        nn.Linear(2, 2).backward(np.ones((1, 2)))


def test_forward_and_backward_hooks_order() -> None:
    model = mlp().eval()
    events: list[str] = []
    model[0].register_forward_pre_hook(lambda m, x: events.append("pre0"))
    model[3].register_forward_hook(lambda m, x, y: events.append("post3"))
    model[3].register_backward_pre_hook(lambda m, g: events.append("bpre3"))
    h = model[0].register_backward_hook(lambda m, g, gi: events.append("bpost0"))
    model[3].weight.register_post_accumulate_grad_hook(lambda p: events.append("grad3w"))
    model[0].bias.register_post_accumulate_grad_hook(lambda p: events.append("grad0b"))
    model(np.ones((2, 3)))
    model.backward(np.ones((2, 2)))
    assert events == ["pre0", "post3", "bpre3", "grad3w", "bpost0", "grad0b"]
    h.remove()
    events.clear()
    model(np.ones((2, 3)))
    model.backward(np.ones((2, 2)))
    assert "bpost0" not in events


def test_hooks_can_replace_values() -> None:
    lin = nn.Linear(2, 2, dtype=np.float64)
    lin.register_forward_hook(lambda m, x, y: y * 0)
    lin.register_backward_hook(lambda m, g, gi: gi + 1)
    assert not lin(np.ones((1, 2))).any()
    np.testing.assert_allclose(lin.backward(np.zeros((1, 2))), np.ones((1, 2)))


def test_hooks_fire_once_through_super_backward() -> None:
    class Scaled(nn.Linear):
        def backward(self, grad_out: np.ndarray) -> np.ndarray:
            return super().backward(grad_out * 2)

    lin = Scaled(2, 2)
    calls: list[int] = []
    lin.register_backward_hook(lambda m, g, gi: calls.append(1))
    lin.weight.register_post_accumulate_grad_hook(lambda p: calls.append(2))
    lin(np.ones((1, 2), dtype=np.float32))
    lin.backward(np.ones((1, 2), dtype=np.float32))
    assert calls == [1, 2]


def test_save_and_restore_context_allows_interleaved_microbatches() -> None:
    model = mlp().eval()
    x1, x2 = np.ones((2, 3)), np.full((2, 3), 2.0)
    g = np.ones((2, 2))
    model(x1)
    ref1 = model.backward(g)
    model(x2)
    ref2 = model.backward(g)
    model(x1)
    c1 = model.save_context()
    model(x2)
    c2 = model.save_context()
    model.restore_context(c1)
    np.testing.assert_array_equal(model.backward(g), ref1)
    model.restore_context(c2)
    np.testing.assert_array_equal(model.backward(g), ref2)


def test_to_dtype_and_devices() -> None:
    model = mlp(dtype=np.float32)
    model.to(dtype=np.float64)
    assert all(p.dtype == np.float64 for p in model.parameters())
    assert model.to("cpu") is model
    with pytest.raises(ValueError, match="cuda:<index>"):
        model.to("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match=r"pip install -e '\.\[gpu\]'"):
            model.to("cuda:0")


def test_parse_device() -> None:
    assert str(nn.parse_device("cuda")) == "cuda:0"
    assert str(nn.parse_device("CUDA:3")) == "cuda:3"
    with pytest.raises(ValueError):
        nn.parse_device("cuda:-1")


def test_bad_layer_arguments() -> None:
    with pytest.raises(ValueError, match="positive"):
        nn.Linear(0, 3)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        nn.CausalSelfAttention(10, 3)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        nn.Dropout(1.0)
    with pytest.raises(ValueError, match="last dim 3"):
        nn.Linear(3, 2)(np.ones((2, 4)))
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        nn.Embedding(4, 2)(np.array([4]))
    with pytest.raises(TypeError, match="Modules"):
        nn.Sequential(nn.Linear(2, 2), "relu")  # type: ignore[arg-type]
