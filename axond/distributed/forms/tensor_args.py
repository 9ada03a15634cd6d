"""Let axond's collectives take torch tensors, without importing torch unless one is passed.

`accepts_torch` wraps a module-level collective: when an argument (or an element of a list argument)
is a torch object, the call goes through the converter `CONVERTERS` names (`axond.torch.arguments`), which
passes NumPy views of the tensors and turns array results back into tensors. Core axond never imports torch itself.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from axond.distributed.diagnostics.failure import debug
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import DistributedError

F = TypeVar("F", bound=Callable[..., Any])


_PLAIN = (np.ndarray, int, float, str, type(None))
"""Argument types that are never torch's: checked first, so NumPy calls pay almost nothing."""
_NEVER_TORCH = frozenset((*_PLAIN, bool, ReduceOp))
"""Exact argument types the wrapper passes without a look (a set lookup: small ops are mostly overhead)."""


def is_torch(x: Any) -> bool:
    """Whether `x` (or an element of a list/tuple `x`) comes from torch; checked by module name, no import."""
    if isinstance(x, _PLAIN):
        return False
    if isinstance(x, (list, tuple)):
        return any(type(v).__module__.startswith("torch") for v in x)
    return type(x).__module__.startswith("torch")


def accepts_torch(fn: F) -> F:
    """Route calls with torch arguments through the torch adapter; others run unchanged.

    This is the public boundary of every module-level collective, so a `DistributedError` leaves it
    without axond's internal frames: the user's frames and one line (AXOND_DEBUG=1 keeps them all).
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            for a in args:
                if type(a) not in _NEVER_TORCH and is_torch(a):
                    return _with_tensors(fn, args, kwargs)
            if kwargs:
                for v in kwargs.values():
                    if type(v) not in _NEVER_TORCH and is_torch(v):
                        return _with_tensors(fn, args, kwargs)
            return fn(*args, **kwargs)
        except DistributedError as e:
            if debug():
                raise
            raise e.with_traceback(None) from e.__cause__
    return wrapper  # type: ignore[return-value]


CONVERTERS = {"torch": "axond.torch.arguments"}
"""The library an argument comes from -> the module whose `call_with_tensors(fn, args, kwargs)` runs a collective on
its objects: a registry by module path, loaded on first use as the backend registry loads backends (the data plane
imports nothing of `axond.torch`, which imports the data plane)."""
_loaded: dict[str, Callable[..., Any]] = {}


def _with_tensors(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = _loaded.get("torch")
    if call is None:
        call = _loaded["torch"] = importlib.import_module(CONVERTERS["torch"]).call_with_tensors
    return call(fn, args, kwargs)
