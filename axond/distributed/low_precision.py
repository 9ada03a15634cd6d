"""Sums of low-precision arrays (bfloat16, float16) that move them in their own dtype and round once.

A ring or tree passes partial sums from rank to rank: in bfloat16 they would be rounded at every hop,
in float32 they would double the bytes. Instead every rank receives the other ranks' values of its
own block (all_to_all, bfloat16 on the wire: the bytes a ring reduce-scatter moves), adds them in
float32 in rank order, rounds once, and an all_gather (bfloat16) hands every rank every block. Every
rank therefore holds the same bits, and the result equals the float32 sum rounded once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import finish_average

AllToAll = Callable[[np.ndarray], np.ndarray]
AllGather = Callable[[np.ndarray, np.ndarray], np.ndarray]


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


def all_reduce(x: np.ndarray, op: ReduceOp, wide: np.dtype, size: int, all_to_all: AllToAll,
               all_gather: AllGather) -> None:
    """SUM/AVG all_reduce of low-precision `x` in place: all_to_all, add in `wide`, round, all_gather."""
    flat = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
    rows = _blocks(flat, size)
    mine = sum_own_block(all_to_all(rows), op, wide, np.empty(rows.shape[1], x.dtype))
    all_gather(mine, rows)
    if not np.shares_memory(rows, x):
        np.copyto(x, rows.reshape(-1)[: x.size].reshape(x.shape))


def reduce_scatter(x: np.ndarray, op: ReduceOp, wide: np.dtype, size: int, all_to_all: AllToAll,
                   out: np.ndarray) -> np.ndarray:
    """SUM/AVG reduce_scatter of low-precision `x` (rows divisible by `size`) into `out`."""
    rows = np.ascontiguousarray(x).reshape(size, -1)
    sum_own_block(all_to_all(rows), op, wide, out.reshape(-1))
    return out
