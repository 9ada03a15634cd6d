"""The check every collective makes of its array arguments first: a scalar is refused, saying to pass an array."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def refuse_scalar(x: Any, op: str) -> None:
    """Raise TypeError for a Python or NumPy scalar: collectives write into arrays, so say to pass one."""
    if isinstance(x, (numbers.Number, np.generic)):
        value = x.item() if isinstance(x, np.generic) else x
        raise TypeError(f"{op}: got the scalar {value!r} ({type(x).__name__}); collectives work in place on arrays. "
                        f"Pass a 1-element array, e.g. x = np.array([{value!r}]), and read x[0] afterwards")
