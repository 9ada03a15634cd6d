"""The small collectives of a one-host group in one round through its mailbox (see `mailbox`): each rank posts its
payload, then reads what it needs from every member's slot. Reductions run in rank order, as everywhere."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp.shm.mailbox import HEAD, Mailbox
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


class SmallAllReduce:
    """A mailbox all_reduce of one dtype, size and op, prepared by its first call: the frame header's fixed fields,
    this rank's payload and every member's row in both buffers, the ufunc. A later call (`run`, inside the group's
    `run`) writes the header and payload, posts, waits and reduces; it makes its `Call` only when the wait is long
    or a member posted another call (`Mailbox.settle`). The tcp backend keeps one per dtype, size and op."""

    __slots__ = ("box", "head", "nbytes", "mine", "rows", "ufunc", "average", "make_call")

    def __init__(self, box: Mailbox, c: Call, x: np.ndarray, op: ReduceOp, make_call: Callable[[int], Call]) -> None:
        self.box = box
        self.head = c.expect
        self.nbytes = x.nbytes
        views = [box.payloads(buf, x.dtype, x.size) for buf in (0, 1)]
        self.mine = [view[box.rank] for view in views]
        self.rows = [list(view) for view in views]
        self.ufunc: Callable[..., np.ndarray] = UFUNCS[op]
        self.average = op is ReduceOp.AVG
        self.make_call = make_call
        """Makes this call's `Call` from its sequence number (`FramedGroup.call`)."""

    def run(self, x: np.ndarray, seq: int) -> None:
        """x (flat, contiguous, of the prepared dtype and size) <- the reduction over the group, as `all_reduce`."""
        box = self.box
        box.ops += 1
        k = box.ops
        buf = k & 1
        me = box.base[buf][box.rank]
        kind, op, dtype, redop, _, gid, aux, count = self.head
        HEAD.pack_into(box.raw, me + 8, kind, op, dtype, redop, seq & 0xFFFFFFFF, gid, aux, count, self.nbytes)
        np.copyto(self.mine[buf], x)
        box.words[me // 8] = k  # last: a peer that sees the sequence number sees the rest (x86 store order)
        box.settle(buf, k, self.nbytes, lambda: self.make_call(seq))
        rows, ufunc = self.rows[buf], self.ufunc
        ufunc(rows[0], rows[1], out=x)
        for p in range(2, len(rows)):
            ufunc(x, rows[p], out=x)
        if self.average:
            finish_average(x, len(rows))


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
