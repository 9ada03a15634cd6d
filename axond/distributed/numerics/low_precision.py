"""Sums of low-precision arrays (bfloat16, float16) that move them in their own dtype and round once.

A ring or tree passes partial sums from rank to rank: in bfloat16 they would be rounded at every hop,
in float32 they would double the bytes. Instead every rank receives the other ranks' values of its
own block (all_to_all, bfloat16 on the wire: the bytes a ring reduce-scatter moves), adds them in
float32 in rank order, rounds once, and an all_gather (bfloat16) hands every rank every block. Every
rank therefore holds the same bits, and the result equals the float32 sum rounded once. PRODUCT and
`reduce` to one rank widen the whole array to float32 instead (rare; kept simple).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import accumulator, finish_average, narrow_into


class Collectives(Protocol):
    """The backend collectives the low-precision reductions are built from."""

    rank: int
    size: int

    def all_reduce(self, x: np.ndarray, op: ReduceOp) -> None: ...

    def reduce(self, x: np.ndarray, dst: int, op: ReduceOp) -> None: ...

    def reduce_scatter(self, x: np.ndarray, op: ReduceOp, out: np.ndarray | None = None) -> np.ndarray: ...

    def all_to_all(self, x: np.ndarray) -> np.ndarray: ...

    def all_gather(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray: ...


def _blocks(flat: np.ndarray, size: int) -> np.ndarray:
    """`flat` as (size, chunk) rows, zero-padded at the end when it does not divide (a view when it does)."""
    chunk = -(-flat.size // size)
    if chunk * size == flat.size:
        return flat.reshape(size, chunk)
    padded = np.zeros(chunk * size, flat.dtype)
    padded[: flat.size] = flat
    return padded.reshape(size, chunk)


def sum_own_block(rows: np.ndarray, op: ReduceOp, wide: np.dtype, out: np.ndarray) -> np.ndarray:
    """out <- rows summed over axis 0 in `wide` (rank order), averaged for AVG, rounded once to out's dtype."""
    acc = rows[0].astype(wide)
    for row in rows[1:]:
        np.add(acc, row, out=acc)
    if op is ReduceOp.AVG:
        finish_average(acc, len(rows))
    np.copyto(out, acc, casting="unsafe")
    return out


def all_reduce(b: Collectives, x: np.ndarray, op: ReduceOp) -> bool:
    """All-reduce low-precision `x` in place as described above (PRODUCT: widened); False if `x` is not
    low precision (the caller reduces it as usual)."""
    wide = accumulator(x.dtype, op)
    if wide is None:
        return False
    if op is ReduceOp.PRODUCT:
        acc = x.astype(wide)
        b.all_reduce(acc, op)
        narrow_into(x, acc)
        return True
    flat = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
    rows = _blocks(flat, b.size)
    mine = sum_own_block(b.all_to_all(rows), op, wide, np.empty(rows.shape[1], x.dtype))
    b.all_gather(mine, out=rows)
    if not np.shares_memory(rows, x):
        np.copyto(x, rows.reshape(-1)[: x.size].reshape(x.shape))
    return True


def reduce_scatter(b: Collectives, x: np.ndarray, op: ReduceOp, out: np.ndarray) -> bool:
    """Reduce-scatter low-precision `x` (rows divisible by the group size) into `out`; False if not low precision."""
    wide = accumulator(x.dtype, op)
    if wide is None:
        return False
    if op is ReduceOp.PRODUCT:
        narrow_into(out, b.reduce_scatter(x.astype(wide), op))
        return True
    rows = np.ascontiguousarray(x).reshape(b.size, -1)
    sum_own_block(b.all_to_all(rows), op, wide, out.reshape(-1))
    return True


def reduce(b: Collectives, x: np.ndarray, dst: int, op: ReduceOp) -> bool:
    """Reduce low-precision `x` to `dst` through float32 (widened, reduced, rounded once there)."""
    wide = accumulator(x.dtype, op)
    if wide is None:
        return False
    acc = x.astype(wide)
    b.reduce(acc, dst, op)
    if b.rank == dst:
        narrow_into(x, acc)
    return True
