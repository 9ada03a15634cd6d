"""What an NCCL op decides before it touches the GPU, computed once and reused: GPU-free, so CI tests it.

`PlanCache` resolves a reduction or a data movement to NCCL's integer constants and element count once per
(op, dtype, count); `Pool` hands out reusable objects (the backend's CUDA events); the argument checks raise
the messages every backend gives. `backend.py` and `ops.py` combine them with CuPy calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from axond.distributed.backends.nccl.support import reduction_plan, transfer_type

T = TypeVar("T")


@dataclass(frozen=True)
class Planned:
    """One op's NCCL call, resolved: data type and op constants, element count, and AVG's division after."""

    nccl_type: int
    nccl_op: int
    count: int
    """NCCL elements (array elements times the type's factor: 2 for complex, itemsize for bytes)."""
    divide_by_size: bool
    element_bytes: int
    """Bytes per NCCL element (what an offset in elements is multiplied by)."""


class PlanCache:
    """Plans by (kind, op, dtype, count), their NCCL names resolved through `const` once; refusals are not cached.

    Bounded: past `limit` entries the cache starts over (a training loop uses a handful of shapes).
    """

    def __init__(self, const: Callable[[str], int], nccl_version: int, limit: int = 4096) -> None:
        self._const = const
        self._version = nccl_version
        self._limit = limit
        self._plans: dict[tuple[Any, ...], Planned] = {}
        self.misses = 0

    def reduction(self, dtype: np.dtype[Any], op: Any, size: int) -> Planned:
        """The plan of reducing `size` elements of `dtype` with `op`; raises TypeError as `reduction_plan` does."""
        key = ("reduce", op, dtype, size)
        plan = self._plans.get(key)
        if plan is None:
            p = reduction_plan(dtype, op, self._version)
            plan = self._put(key, Planned(self._const(p.nccl_type), self._const(p.nccl_op), size * p.count_factor,
                                          p.divide_by_size, dtype.itemsize // p.count_factor))
        return plan

    def transfer(self, dtype: np.dtype[Any], size: int) -> Planned:
        """The plan of moving `size` elements of `dtype` (native type, else bytes); `nccl_op` is unused (-1)."""
        key = ("move", dtype, size)
        plan = self._plans.get(key)
        if plan is None:
            name, factor = transfer_type(dtype, self._version)
            plan = self._put(key, Planned(self._const(name), -1, size * factor, False, dtype.itemsize // factor))
        return plan

    def _put(self, key: tuple[Any, ...], plan: Planned) -> Planned:
        self.misses += 1
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def __len__(self) -> int:
        return len(self._plans)


class Pool(Generic[T]):
    """Reusable objects (CUDA events): `get` one, `put` it back once nothing will record or query it again.

    Lock-free (list append and pop are atomic in CPython); at most `limit` idle objects are kept.
    """

    def __init__(self, make: Callable[[], T], limit: int = 256) -> None:
        self._make = make
        self._limit = limit
        self._free: list[T] = []
        self.made = 0

    def get(self) -> T:
        try:
            return self._free.pop()
        except IndexError:
            self.made += 1
            return self._make()

    def put(self, item: T) -> None:
        if len(self._free) < self._limit:
            self._free.append(item)

    def __len__(self) -> int:
        return len(self._free)


def check_peer(peer: Any, size: int, group: str, what: str, op: str) -> None:
    """Raise ValueError unless `peer` is a rank of a group of `size`."""
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < size:
        raise ValueError(f"nccl {op}: {what}={peer!r} is not a rank of group {group!r} (size {size})")


def split_rows(shape: tuple[int, ...], size: int, op: str) -> int:
    """The first dimension of `shape`, which `op` splits among `size` ranks; ValueError unless it divides."""
    if not shape or shape[0] % size:
        raise ValueError(f"{op} needs x.shape[0] divisible by the group size {size}; "
                         f"got shape {shape} (pad the first dimension)")
    return int(shape[0])


def check_out(shape: tuple[int, ...], dtype: Any, want_shape: tuple[int, ...], want_dtype: Any, op: str) -> None:
    """Raise ValueError unless an `out=` array of `shape` and `dtype` is what `op` produces."""
    if tuple(shape) != tuple(want_shape) or dtype != want_dtype:
        raise ValueError(f"nccl {op} out= must be a {want_dtype} array of shape {tuple(want_shape)}; "
                         f"got {dtype} {tuple(shape)}")
