"""The trainer's view of a data set: `(X, y)` arrays or any object with `__len__` and `__getitem__(indices)`."""

from __future__ import annotations

from typing import Any

import numpy as np


class Dataset:
    """Uniform access: `len(d)` samples, `d.batch(indices) -> (x, y)` for an int64 index array."""

    def __init__(self, data: Any, name: str = "dataset") -> None:
        if isinstance(data, tuple):
            if len(data) != 2:
                raise ValueError(f"{name} as a tuple must be (X, y), got {len(data)} items")
            x, y = data
            if not (hasattr(x, "shape") and hasattr(y, "shape")):
                raise TypeError(f"{name} (X, y) must be arrays, got {type(x).__name__} and {type(y).__name__}")
            if len(x) != len(y):
                raise ValueError(f"{name}: X has {len(x)} rows but y has {len(y)}")
        elif not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise TypeError(f"{name} must be a tuple (X, y) or have __len__ and __getitem__(index_array) -> (x, y); "
                            f"got {type(data).__name__}")
        self.data = data
        self.name = name

    def __len__(self) -> int:
        return len(self.data[0]) if isinstance(self.data, tuple) else len(self.data)

    def batch(self, indices: np.ndarray) -> tuple[Any, Any]:
        if isinstance(self.data, tuple):
            return self.data[0][indices], self.data[1][indices]
        item = self.data[indices]
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{self.name}[indices] must return (x, y), got {type(item).__name__}")
        return item
