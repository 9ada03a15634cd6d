"""Optimizers updating `Parameter.data` in place: SGD (momentum, nesterov, weight decay) and AdamW.

The update rules are torch's, written with in-place array ops so no step allocates per parameter
more than one temporary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

from axond.nn.device import Array, array_module
from axond.nn.module import Parameter


def _checked_step(fn: Callable[[Optimizer], None]) -> Callable[[Optimizer], None]:
    """Wrap a subclass's `step` so that the parameters' pre-step hooks run first (they may refuse the step)."""

    @functools.wraps(fn)
    def step(self: Optimizer) -> None:
        for p in self.params:
            if p._step_hooks:
                p._before_step()
        fn(self)

    step._axond_checked = True  # type: ignore[attr-defined]
    return step


class Optimizer:
    """Holds the parameters, their per-parameter state and the hyper-parameters.

    Every subclass's `step` first runs the parameters' pre-step hooks (`Parameter.register_pre_step_hook`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("step")
        if fn is not None and not getattr(fn, "_axond_checked", False):
            cls.step = _checked_step(fn)  # type: ignore[method-assign, assignment]

    def __init__(self, params: Iterable[Parameter], defaults: dict[str, Any]) -> None:
        self.params: list[Parameter] = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        for i, p in enumerate(self.params):
            if not isinstance(p, Parameter):
                raise TypeError(f"{type(self).__name__} expects Parameters; item {i} is a {type(p).__name__}")
        self.defaults = dict(defaults)
        self.state: list[dict[str, Any]] = [{} for _ in self.params]

    @property
    def lr(self) -> float:
        return float(self.defaults["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.defaults["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.fill(0)

    def step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters and per-parameter state (arrays by reference, flat names "i.key")."""
        arrays = {f"{i}.{k}": v for i, st in enumerate(self.state) for k, v in st.items()}
        return {"defaults": dict(self.defaults), "state": arrays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy hyper-parameters and per-parameter state (arrays copied) from `state_dict()`, after checking it fits."""
        for key, value in state["state"].items():
            index, name = key.split(".", 1)
            i = int(index)
            if i >= len(self.params):
                raise ValueError(f"optimizer state names parameter {i}, but there are {len(self.params)}")
            shape = tuple(getattr(value, "shape", ()))
            if shape and shape != self.params[i].shape:
                raise ValueError(
                    f"optimizer state {key!r} has shape {shape} but parameter {i} has shape {self.params[i].shape}: "
                    "the state was saved under another sharding (world size or wrapper); save and load it with "
                    "axond.checkpoint, which reshards"
                )
        self.defaults.update(state["defaults"])
        self.state = [{} for _ in self.params]
        for key, value in state["state"].items():
            index, name = key.split(".", 1)
            i = int(index)
            xp = array_module(self.params[i].data)
            self.state[i][name] = xp.array(value, copy=True) if hasattr(value, "shape") else value


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, nesterov and L2 weight decay."""

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"SGD needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("SGD nesterov needs momentum > 0 and dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def step(self) -> None:
        d = self.defaults
        lr, momentum, dampening, wd = d["lr"], d["momentum"], d["dampening"], d["weight_decay"]
        for p, st in zip(self.params, self.state):
            if p.grad is None or not p.requires_grad:
                continue
            g = -p.grad if d["maximize"] else p.grad
            if wd:
                g = g + wd * p.data
            if momentum:
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = st["momentum_buffer"] = g.copy()
                else:
                    buf *= momentum
                    buf += (1.0 - dampening) * g
                g = g + momentum * buf if d["nesterov"] else buf
            p.data -= lr * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), bias-corrected, optional AMSGrad."""

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"AdamW needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    def step(self) -> None:
        d = self.defaults
        lr, (b1, b2), eps, wd = d["lr"], d["betas"], d["eps"], d["weight_decay"]
        for p, st in zip(self.params, self.state):
            if p.grad is None or not p.requires_grad:
                continue
            xp = array_module(p.data)
            g = p.grad
            if not st:
                st["step"] = 0
                st["exp_avg"] = xp.zeros_like(p.data)
                st["exp_avg_sq"] = xp.zeros_like(p.data)
                if d["amsgrad"]:
                    st["max_exp_avg_sq"] = xp.zeros_like(p.data)
            st["step"] += 1
            t = st["step"]
            if wd:
                p.data *= 1.0 - lr * wd
            m: Array = st["exp_avg"]
            v: Array = st["exp_avg_sq"]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * (g * g)
            if d["amsgrad"]:
                vmax = st["max_exp_avg_sq"]
                xp.maximum(vmax, v, out=vmax)
                v = vmax
            bias1 = 1.0 - b1**t
            bias2 = 1.0 - b2**t
            denom = xp.sqrt(v) / math.sqrt(bias2)
            denom += eps
            p.data -= (lr / bias1) * (m / denom)
