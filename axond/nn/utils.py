"""Gradient clipping and checkpoint files (NumPy .npz, never pickled)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from axond.nn.device import Array, array_module, is_cupy_array
from axond.nn.module import Parameter


def clip_grad_norm_(
    parameters: Iterable[Parameter], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> float:
    """Scale gradients in place so that their joint `norm_type` norm is at most `max_norm`; return the norm before."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if norm_type == math.inf:
        total = max(float(array_module(g).abs(g).max()) for g in grads)
    else:
        total = sum(float((array_module(g).abs(g) ** norm_type).sum()) for g in grads) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise FloatingPointError(f"the total {norm_type}-norm of the gradients is {total}; pass error_if_nonfinite=False to clip anyway")
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g *= coef
    return total


def save_checkpoint(path: str | os.PathLike[str], arrays: Mapping[str, Array]) -> None:
    """Write name -> array to `path` (.npz) atomically (a temporary file renamed into place)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    host = {k: (v.get() if is_cupy_array(v) else np.asarray(v)) for k, v in arrays.items()}
    with open(tmp, "wb") as f:
        np.savez(f, **host)  # type: ignore[arg-type]
    os.replace(tmp, target)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a file written by `save_checkpoint` (no pickle allowed)."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
