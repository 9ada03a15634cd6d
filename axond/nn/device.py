"""Array-module dispatch (NumPy or CuPy) and device parsing, so that layers are written once.

CuPy is imported only when an array already is a CuPy array or a CUDA device is asked for.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from axond.errors import BackendUnavailable

Array = Any
"""A NumPy or CuPy ndarray."""


@dataclass(frozen=True)
class Device:
    """Where arrays live."""

    kind: Literal["cpu", "cuda"]
    """"cpu" (NumPy) or "cuda" (CuPy)."""
    index: int = 0
    """GPU index for "cuda"; 0 for "cpu"."""

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def parse_device(device: str | Device) -> Device:
    """Parse "cpu", "cuda" or "cuda:i" into a `Device`."""
    if isinstance(device, Device):
        return device
    text = str(device).strip().lower()
    if text == "cpu":
        return Device("cpu")
    if text == "cuda":
        return Device("cuda", 0)
    if text.startswith("cuda:"):
        try:
            index = int(text[5:])
        except ValueError as e:
            raise ValueError(f"bad device {device!r}: expected 'cpu', 'cuda' or 'cuda:<index>'") from e
        if index < 0:
            raise ValueError(f"bad device {device!r}: the GPU index must be >= 0")
        return Device("cuda", index)
    raise ValueError(f"bad device {device!r}: expected 'cpu', 'cuda' or 'cuda:<index>'")


def is_cupy_array(x: Any) -> bool:
    """True if `x` is a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


def import_cupy() -> ModuleType:
    """Import CuPy or raise `BackendUnavailable` saying how to install it."""
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            "CUDA arrays need CuPy, which is not installed: pip install -e '.[gpu]' (cupy-cuda12x)"
        ) from e
    return cupy


def array_module(x: Any) -> ModuleType:
    """`numpy` for NumPy arrays (and scalars), `cupy` for CuPy arrays."""
    if is_cupy_array(x):
        return sys.modules["cupy"]
    return np


def device_of(x: Any) -> Device:
    """The device an array lives on."""
    if is_cupy_array(x):
        return Device("cuda", int(x.device.id))
    return Device("cpu")


def to_device(x: Array, device: str | Device) -> Array:
    """Return `x` on `device` (the same object if it already lives there)."""
    target = parse_device(device)
    if device_of(x) == target:
        return x
    if target.kind == "cpu":
        return x.get()
    cupy = import_cupy()
    with cupy.cuda.Device(target.index):
        return cupy.asarray(x)


def empty_on(like: Array, shape: int | tuple[int, ...], dtype: Any) -> Array:
    """An uninitialised array of `shape` on the same device as `like` (NumPy or the GPU `like` is on)."""
    if not is_cupy_array(like):
        return np.empty(shape, dtype=dtype)
    cupy = sys.modules["cupy"]
    with like.device:
        return cupy.empty(shape, dtype=dtype)


def scatter_add(xp: ModuleType, out: Array, indices: Array, values: Array) -> None:
    """out[indices] += values with repeated indices summed (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(out, indices, values)
    else:
        import cupyx

        cupyx.scatter_add(out, indices, values)
