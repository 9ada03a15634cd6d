"""Losses: calling one returns the loss (a float); `.backward()` returns d loss / d prediction."""

from __future__ import annotations

from typing import Literal

from axond.nn.device import Array, array_module

Reduction = Literal["mean", "sum"]


class _Loss:
    def __init__(self, reduction: Reduction = "mean") -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction
        self._ctx: tuple[Array, ...] | None = None

    def _saved(self) -> tuple[Array, ...]:
        if self._ctx is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before the loss was computed")
        ctx, self._ctx = self._ctx, None
        return ctx


class MSELoss(_Loss):
    """mean (or sum) of (prediction - target)^2."""

    def __call__(self, pred: Array, target: Array) -> float:
        if tuple(pred.shape) != tuple(target.shape):
            raise ValueError(f"MSELoss: prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
        diff = pred - target
        self._ctx = (diff,)
        total = float((diff * diff).sum())
        return total / diff.size if self.reduction == "mean" else total

    def backward(self, scale: float = 1.0) -> Array:
        """d (scale * loss) / d prediction."""
        (diff,) = self._saved()
        factor = 2.0 * scale / (diff.size if self.reduction == "mean" else 1)
        return diff * factor


class CrossEntropyLoss(_Loss):
    """Softmax cross-entropy of logits (..., C) against integer classes (...), via a stable log-sum-exp.

    Targets equal to `ignore_index` contribute nothing; "mean" divides by the number of the others.
    """

    def __init__(self, reduction: Reduction = "mean", ignore_index: int = -100, label_smoothing: float = 0.0) -> None:
        super().__init__(reduction)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def __call__(self, logits: Array, target: Array) -> float:
        xp = array_module(logits)
        if tuple(logits.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"CrossEntropyLoss: logits {tuple(logits.shape)} need targets of shape {tuple(logits.shape[:-1])}, got {tuple(target.shape)}"
            )
        if target.dtype.kind not in "iu":
            raise TypeError(f"CrossEntropyLoss targets must be integer class indices, got dtype {target.dtype}")
        c = logits.shape[-1]
        z = logits.reshape(-1, c)
        t = target.reshape(-1)
        valid = t != self.ignore_index
        safe_t = xp.where(valid, t, 0)
        if t.size and (int(safe_t.min()) < 0 or int(safe_t.max()) >= c):
            raise IndexError(f"CrossEntropyLoss targets must lie in [0, {c}) or equal ignore_index={self.ignore_index}")
        shifted = z - z.max(axis=1, keepdims=True)
        lse = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        logp = shifted - lse
        nll = -xp.take_along_axis(logp, safe_t[:, None], axis=1)[:, 0]
        if self.label_smoothing:
            eps = self.label_smoothing
            nll = (1.0 - eps) * nll - eps * logp.mean(axis=1)
        nll = nll * valid
        count = int(valid.sum())
        self._ctx = (logp, safe_t, valid, logits.shape)
        total = float(nll.sum())
        if self.reduction == "sum":
            return total
        return total / count if count else float("nan")

    def backward(self, scale: float = 1.0) -> Array:
        """d (scale * loss) / d logits: (softmax - one_hot) per valid row."""
        logp, safe_t, valid, shape = self._saved()
        xp = array_module(logp)
        n, c = logp.shape
        grad = xp.exp(logp)
        eps = self.label_smoothing
        grad[xp.arange(n), safe_t] -= 1.0 - eps
        if eps:
            grad -= eps / c
        count = int(valid.sum())
        denom = count if (self.reduction == "mean" and count) else 1
        grad *= (valid[:, None] * (scale / denom)).astype(grad.dtype)
        return grad.reshape(shape)
