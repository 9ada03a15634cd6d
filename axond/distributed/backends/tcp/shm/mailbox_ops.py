"""The small collectives of a one-host group in one round through its mailbox (see `mailbox`): each rank posts its
payload, then reads what it needs from every member's slot. Reductions run in rank order, as everywhere."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp.shm.mailbox import Mailbox
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import UFUNCS, finish_average

BYTES = np.dtype(np.uint8)


def reduce_rows(rows: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out <- the reduction of every rank's row of `rows` (size, n), in rank order."""
    ufunc: Callable[..., np.ndarray] = UFUNCS[op]
    ufunc(rows[0], rows[1], out=out)
    for p in range(2, rows.shape[0]):
        ufunc(out, rows[p], out=out)
    if op is ReduceOp.AVG:
        finish_average(out, rows.shape[0])


def all_reduce(box: Mailbox, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    reduce_rows(box.payloads(box.post(c, x), x.dtype, x.size), x, op)


def broadcast(box: Mailbox, c: Call, x: np.ndarray, src: int) -> None:
    buf = box.post(c, x if box.rank == src else None)
    if box.rank != src:
        x.view(np.uint8)[...] = box.payloads(buf, BYTES, x.nbytes)[src]


def all_gather(box: Mailbox, c: Call, out: np.ndarray) -> None:
    rows = out.reshape(box.size, -1).view(np.uint8)
    rows[...] = box.payloads(box.post(c, rows[box.rank]), BYTES, rows.shape[1])


def reduce_scatter(box: Mailbox, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    per = out.size
    parts = box.payloads(box.post(c, src), src.dtype, src.size)[:, box.rank * per : (box.rank + 1) * per]
    reduce_rows(parts, out, op)


def barrier(box: Mailbox, c: Call) -> None:
    box.post(c, None)
