"""DDP's low-precision working copies of the parameters (`MixedPrecision.param_dtype`).

The masters stay the parameters' own arrays (what the optimizer updates). For a forward and its
backward each parameter's `.data` points at a copy cast to `param_dtype`; `restore` points it back
at the master, so an optimizer step always sees the masters.
"""

from __future__ import annotations

from collections.abc import Sequence

from axond.nn.device import Array
from axond.nn.module import Parameter
from axond.parallel.mixed_precision import MixedPrecision


class WorkingParams:
    """Swap parameters between their masters and `param_dtype` working copies."""

    def __init__(self, params: Sequence[Parameter], mixed_precision: MixedPrecision | None) -> None:
        mp = mixed_precision
        self.params = [p for p in params if mp is not None and mp.compute(p.dtype) != p.dtype]
        self.dtype = mp.param_dtype if mp is not None else None
        self._masters: list[Array] | None = None
        self._master_of: dict[int, Array] = {}

    @property
    def active(self) -> bool:
        """Whether the working copies are in place now."""
        return self._masters is not None

    def cast(self) -> None:
        """Point every parameter at a fresh `param_dtype` copy of its master (one cast per parameter)."""
        if not self.params:
            return
        self.restore()
        self._masters = [p.data for p in self.params]
        self._master_of = {id(p): p.data for p in self.params}
        for p in self.params:
            p.data = p.data.astype(self.dtype)

    def restore(self) -> None:
        """Point every parameter back at its master and drop the working copies."""
        if self._masters is None:
            return
        for p, master in zip(self.params, self._masters):
            p.data = master
        self._masters = None
        self._master_of = {}

    def master(self, param: Parameter) -> Array:
        """`param`'s master array (its `.data` unless a working copy replaces it now)."""
        return self._master_of.get(id(param), param.data)

    def nbytes(self) -> int:
        """Bytes of the working copies alive now."""
        return sum(int(p.data.nbytes) for p in self.params) if self.active else 0

    def cast_grads(self, dtype_of: dict[int, object]) -> None:
        """Cast low-precision `.grad`s to the dtype `dtype_of[id(param)]` (an unsynchronised single-rank pass)."""
        for p in self.params:
            want = dtype_of.get(id(p))
            if p.grad is not None and want is not None and p.grad.dtype != want:
                p.grad = p.grad.astype(want)
