"""Reduction operators of the collectives."""

from __future__ import annotations

from enum import Enum


class ReduceOp(Enum):
    """How `all_reduce`, `reduce` and `reduce_scatter` combine the ranks' arrays.

    AVG is defined on floating-point and complex arrays only (integers are refused: see
    `axond.distributed.numerics.reducers`). AVERAGE is an alias of AVG (the seeds' name). The bitwise
    BAND, BOR and BXOR are defined on integer and bool arrays only.
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    AVERAGE = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    __hash__ = object.__hash__
    """Members are singletons and compare by identity: hashed as such, in C (Enum's own hash is Python code, about
    0.15 us on every small op's signature, `axond.distributed.fast_path`)."""


BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
"""The ops defined on integer and bool arrays only."""
