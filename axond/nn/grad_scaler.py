"""`GradScaler`: dynamic loss scaling for low-precision gradients (torch.amp.GradScaler's shape).

Small gradients underflow in float16 (and lose bits in bfloat16): the loss gradient is multiplied by
`scale` before backward, and the gradients divided by it before the optimizer step. A step whose
gradients hold inf/nan on any rank is skipped on every rank and the scale lowered; after
`growth_interval` good steps in a row the scale grows again. The ranks agree with one all_reduce
(MAX) of a one-element flag over `group`, so the replicas (or shards) never diverge.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from axond.nn.device import Array, array_module
from axond.nn.optim import Optimizer
from axond.distributed import default_registry as defaults
from axond.distributed.numerics.reduce_op import ReduceOp


def _default_group() -> Any:
    return defaults.current()


class GradScaler:
    """Scale the loss gradient, unscale and check the gradients, skip overflowing steps on every rank."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, group: Any = None) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.group = group
        """Where the ranks agree on an overflow (default: axond's default group, if initialised)."""
        self._scale = float(init_scale)
        self._good_steps = 0
        self._unscaled: dict[int, bool] = {}
        """id(optimizer) -> whether its gradients held inf/nan on any rank, for the current step."""
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, x: Array) -> Array:
        """`x` (the loss gradient, or the loss) times the scale, in `x`'s dtype."""
        if not self.enabled:
            return x
        return x * array_module(x).asarray(self._scale, dtype=np.float32).astype(x.dtype)

    def scale_loss(self, loss_fn: Any) -> _ScaledLoss:
        """`loss_fn` whose `backward()` returns the scaled loss gradient: for APIs that call the loss themselves
        (`Pipeline(..., loss_fn=scaler.scale_loss(nn.CrossEntropyLoss()))`). The scale is read at each backward."""
        return _ScaledLoss(loss_fn, self)

    def unscale_(self, optimizer: Optimizer) -> bool:
        """Divide `optimizer`'s gradients by the scale in place (once per step); whether any rank saw inf/nan.

        Collective over `group`: every rank calls it (`step` calls it if you did not, e.g. before clipping).
        """
        key = id(optimizer)
        if key in self._unscaled:
            return self._unscaled[key]
        grads = [p.grad for p in optimizer.params if p.grad is not None]
        inv = 1.0 / self._scale
        flag = np.zeros(1, np.float32)
        for g in grads:
            g *= inv
            if not bool(array_module(g).isfinite(g).all()):
                flag[0] = 1.0
        group = self.group if self.group is not None else _default_group()
        if group is not None and group.size > 1:
            group.all_reduce(flag, op=ReduceOp.MAX)
        self._unscaled[key] = found = bool(flag[0] > 0)
        return found

    def step(self, optimizer: Optimizer) -> bool:
        """Unscale (if not yet) and step `optimizer` unless some rank's gradients overflowed; whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if self.unscale_(optimizer):
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self, new_scale: float | None = None) -> None:
        """End the step: lower the scale after an overflow, raise it after `growth_interval` good steps."""
        if not self.enabled:
            return
        found = any(self._unscaled.values())
        self._unscaled = {}
        if new_scale is not None:
            self._scale = float(new_scale)
        elif found:
            self._scale *= self.backoff_factor
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale *= self.growth_factor
                self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._good_steps = int(state["_growth_tracker"])


class _ScaledLoss:
    """A loss whose `backward(scale)` multiplies by the scaler's current scale (see `GradScaler.scale_loss`)."""

    def __init__(self, loss_fn: Any, scaler: GradScaler) -> None:
        self.loss_fn, self.scaler = loss_fn, scaler

    def __call__(self, pred: Array, target: Array) -> float:
        return float(self.loss_fn(pred, target))

    def backward(self, scale: float = 1.0) -> Array:
        return self.loss_fn.backward(scale * self.scaler.get_scale())
