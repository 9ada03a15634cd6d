"""`MixedPrecision`: which dtypes DDP and FSDP compute, reduce and keep buffers in (torch's field names).

The parameters the optimizer sees stay in the model's own dtype (float32 masters, and so does the
optimizer state); the wrappers cast working copies to `param_dtype` for forward and backward, reduce
gradients in `reduce_dtype`, and hand the optimizer gradients in the masters' dtype unless
`keep_low_precision_grads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from axond.nn.device import Array


def _dtype(value: Any, field: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        dt = np.dtype(value)
    except TypeError as e:
        raise TypeError(f"MixedPrecision.{field} must be a dtype such as axond.bfloat16 or np.float32, "
                        f"got {value!r}") from e
    if dt.kind != "f" and dt.name != "bfloat16":
        raise TypeError(f"MixedPrecision.{field} must be a floating-point dtype, got {dt}")
    return dt


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of one wrapper's compute, gradient reduction and buffers; None keeps the model's dtype."""

    param_dtype: Any = None
    """Dtype of the working parameters that forward and backward compute with (e.g. `axond.bfloat16`)."""
    reduce_dtype: Any = None
    """Dtype the gradients are all-reduced / reduce-scattered in (default: `param_dtype`)."""
    buffer_dtype: Any = None
    """Dtype the module's floating-point buffers are cast to at wrap time."""
    keep_low_precision_grads: bool = False
    """Leave the reduced gradients in `reduce_dtype` instead of casting them to the masters' dtype."""

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, field, _dtype(getattr(self, field), field))
        if not isinstance(self.keep_low_precision_grads, bool):
            raise TypeError("MixedPrecision.keep_low_precision_grads must be a bool, "
                            f"got {self.keep_low_precision_grads!r}")

    def compute(self, master: np.dtype) -> np.dtype:
        """Dtype forward/backward run in for masters of dtype `master`."""
        return self.param_dtype if self.param_dtype is not None else np.dtype(master)

    def reduce(self, master: np.dtype) -> np.dtype:
        """Dtype gradients are reduced in."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.compute(master)

    def grad(self, master: np.dtype) -> np.dtype:
        """Dtype of the gradients handed to the optimizer."""
        return self.reduce(master) if self.keep_low_precision_grads else np.dtype(master)

    def cast_input(self, x: Array) -> Array:
        """A floating-point forward input in `param_dtype` (integers, e.g. token ids, pass unchanged)."""
        if self.param_dtype is None or not hasattr(x, "dtype") or x.dtype == self.param_dtype:
            return x
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            return x
        return x.astype(self.param_dtype)


def check_mixed_precision(value: Any) -> MixedPrecision | None:
    """`value` if it is a MixedPrecision or None, else a clear error."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    raise TypeError(f"mixed_precision must be an axond.parallel.MixedPrecision or None, got {value!r}")


def cast_buffers(module: Any, mp: MixedPrecision | None) -> None:
    """Cast `module`'s floating-point buffers to `mp.buffer_dtype` in place of the originals."""
    if mp is None or mp.buffer_dtype is None:
        return
    for m in module.modules():
        for name, buf in list(m._buffers.items()):
            if buf is not None and (buf.dtype.kind == "f" or buf.dtype.name == "bfloat16"):
                m._buffers[name] = buf.astype(mp.buffer_dtype)
