"""What an optimizer holds, in bytes: the figure every wrapper's `memory_stats()` and `memory_estimate` share."""

from __future__ import annotations

from typing import Any


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the arrays in `optimizer.state` (an axond.nn.optim optimizer or ZeRO-1's), 0 for None."""
    if optimizer is None:
        return 0
    return sum(int(v.nbytes) for st in getattr(optimizer, "state", []) for v in st.values() if hasattr(v, "nbytes"))
