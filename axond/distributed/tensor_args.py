"""Let axond's collectives take torch tensors, without importing torch unless one is passed.

`accepts_torch` wraps a module-level collective: when an argument (or an element of a list argument)
is a torch object, the call goes through `axond.torch.arguments`, which passes NumPy views of the
tensors and turns array results back into tensors. Core axond never imports torch itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from axond.distributed.failure import debug
from axond.errors import DistributedError

F = TypeVar("F", bound=Callable[..., Any])


_PLAIN = (np.ndarray, int, float, str, type(None))
"""Argument types that are never torch's: checked first, so NumPy calls pay almost nothing."""


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
            if any(is_torch(a) for a in args) or any(is_torch(v) for v in kwargs.values()):
                from axond.torch.arguments import call_with_tensors

                return call_with_tensors(fn, args, kwargs)
            return fn(*args, **kwargs)
        except DistributedError as e:
            if debug():
                raise
            raise e.with_traceback(None) from e.__cause__
    return wrapper  # type: ignore[return-value]
