"""Reduction operators of the collectives."""

from __future__ import annotations

from enum import Enum


class ReduceOp(Enum):
    """How `all_reduce`, `reduce` and `reduce_scatter` combine the ranks' arrays."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
