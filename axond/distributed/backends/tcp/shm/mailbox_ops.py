"""The small collectives of a one-host group in one round through its mailbox (see `mailbox`): each rank posts its
payload, then reads what it needs from every member's slot. Reductions run in rank order, as everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.backends.host_copy import copy
from axond.distributed.backends.tcp.shm.mailbox import HEAD, SEQ_FIELD, Mailbox, _fastbox
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average

BYTES = np.dtype(np.uint8)
NATIVE_DTYPES = {} if _fastbox is None else {
    np.dtype(np.float32): _fastbox.FLOAT32, np.dtype(np.float64): _fastbox.FLOAT64,
    np.dtype(np.int32): _fastbox.INT32, np.dtype(np.int64): _fastbox.INT64,
}
"""The dtypes whose reductions the compiled ops run (others reduce in NumPy, on the Python path)."""
NATIVE_REDUCTIONS = {} if _fastbox is None else {
    ReduceOp.SUM: _fastbox.SUM, ReduceOp.AVG: _fastbox.SUM, ReduceOp.PRODUCT: _fastbox.PRODUCT,
    ReduceOp.MIN: _fastbox.MIN, ReduceOp.MAX: _fastbox.MAX,
}


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


def _reduce_listed(rows: list[np.ndarray], out: np.ndarray, ufunc: Callable[..., np.ndarray], average: bool) -> None:
    """out <- every member's row of `rows` reduced in rank order with `ufunc` (then averaged): a prepared op's
    reduction."""
    ufunc(rows[0], rows[1], out=out)
    for p in range(2, len(rows)):
        ufunc(out, rows[p], out=out)
    if average:
        finish_average(out, len(rows))


class Prepared:
    """A mailbox op of one call shape (op, dtype, size, root or reduction), prepared by its first call: the frame
    header with the sequence number left out, and the payload views of both buffers. A later call (`post`, inside
    the group's `run`) writes the header, its sequence number, its payload and its sequence word, waits and compares
    the members' calls; it makes its `Call` only when the wait is long or a member posted another call
    (`Mailbox.settle`). The group's fast path keeps the prepared forms by signature, as runners (`tcp.prepared`,
    `axond.distributed.fast_path`).

    Where the compiled helper is built (`_fastbox`, the same protocol in C), `native` runs the whole call in one C
    call when every member posted the same call within the wait's first turns; otherwise it hands back the buffer it
    posted in, and `settled` waits and compares as `Mailbox.settle` does, then lets it read the result."""

    __slots__ = ("box", "header", "posted", "make_call", "native")

    def __init__(self, box: Mailbox, c: Call, make_call: Callable[[int], Call], posted: int = 0) -> None:
        self.box = box
        kind, op, dtype, redop, _, gid, aux, count = c.expect
        self.header = HEAD.pack(kind, op, dtype, redop, 0, gid, aux, count, posted)
        """The slot's header words of every call of this shape, the sequence number 0 (`post` writes it after)."""
        self.posted = posted
        """Payload bytes this rank posts (a broadcast's other ranks post none)."""
        self.make_call = make_call
        """Makes this call's `Call` from its sequence number (`FramedGroup.call`)."""
        self.native: Any = None
        """The compiled form of this op (`_fastbox.Op`, made by `compile`), or None: the Python path."""

    def compile(self, kind: str, nbytes: int, root: int = 0, dtype: np.dtype | None = None,
                op: ReduceOp | None = None, count: int = 0, part: int = 0, out_bytes: int = 0) -> None:
        """Make `native` where the box has the compiled helper and it runs this op (a reduction: of a dtype and op
        in NATIVE_DTYPES and NATIVE_REDUCTIONS). `kind` names a `_fastbox` kind; `nbytes`: the bytes of the array
        its `run` takes."""
        box = self.box
        if box.native is None:
            return
        code = _fastbox.NO_DTYPE
        if op is not None:
            if dtype not in NATIVE_DTYPES or op not in NATIVE_REDUCTIONS:
                return
            code = NATIVE_DTYPES[dtype]
        self.native = _fastbox.Op(box.native, getattr(_fastbox, kind), box.rank, box.size,
                                  [at for base in box.base for at in base], self.header, self.posted, nbytes, root,
                                  code, 0 if op is None else NATIVE_REDUCTIONS[op], op is ReduceOp.AVG, count, part,
                                  out_bytes)

    def settled(self, buf: int, seq: int, a: np.ndarray | None = None, b: np.ndarray | None = None) -> bool:
        """After `native.run` posted call `seq` in buffer `buf` but did not finish it: wait for the members and
        compare their calls (`Mailbox.settle`: raises naming the peer), then read the result (True)."""
        self.box.settle(buf, self.box.count.ops, self.posted, self.make_call, seq)
        self.native.finish(buf, a, b)
        return True

    def post(self, seq: int, payload: np.ndarray | None, slots: list[np.ndarray]) -> int:
        """As `Mailbox.post` for call number `seq`: `payload` goes into this rank's slot of the buffer (`slots`: one
        view per buffer); returns the buffer."""
        box = self.box
        count = box.count
        count.ops += 1
        k = count.ops
        buf = k & 1
        me = box.base[buf][box.rank]
        words = box.words
        box.mapping[me + 8 : me + 8 + HEAD.size] = self.header  # a copy of bytes: ~100 ns under packing the fields
        words[me // 8 + 1 + SEQ_FIELD] = seq & 0xFFFFFFFF
        if payload is not None:
            slots[buf][...] = payload  # same dtype and size: a third of np.copyto's cost on a few bytes
        box.publish(me, k)  # last: a peer that sees the sequence number sees the rest (x86 store order)
        box.settle(buf, k, self.posted, self.make_call, seq)
        return buf


class SmallAllReduce(Prepared):
    """A prepared mailbox all_reduce (see `Prepared`): this rank's payload and every member's row in both buffers,
    the ufunc."""

    __slots__ = ("mine", "rows", "ufunc", "average")

    def __init__(self, box: Mailbox, c: Call, x: np.ndarray, op: ReduceOp, make_call: Callable[[int], Call]) -> None:
        super().__init__(box, c, make_call, x.nbytes)
        views = [box.payloads(buf, x.dtype, x.size) for buf in (0, 1)]
        self.mine = [view[box.rank] for view in views]
        self.rows = [list(view) for view in views]
        self.ufunc: Callable[..., np.ndarray] = UFUNCS[op]
        self.average = op is ReduceOp.AVG
        self.compile("ALL_REDUCE", x.nbytes, dtype=x.dtype, op=op, count=x.size)

    def run(self, x: np.ndarray, seq: int) -> None:
        """x (flat, contiguous, of the prepared dtype and size) <- the reduction over the group, as `all_reduce`."""
        native = self.native
        if native is not None:
            buf = native.run(seq, x)
            if buf is None or (buf >= 0 and self.settled(buf, seq, x)):
                return
        _reduce_listed(self.rows[self.post(seq, x, self.mine)], x, self.ufunc, self.average)


class SmallBroadcast(Prepared):
    """A prepared mailbox broadcast of `nbytes` (at most a slot) from one root (see `Prepared`): the root's row in both
    buffers, as bytes."""

    __slots__ = ("root", "rows")

    def __init__(self, box: Mailbox, c: Call, nbytes: int, src: int, make_call: Callable[[int], Call]) -> None:
        self.root = box.rank == src
        super().__init__(box, c, make_call, nbytes if self.root else 0)
        self.rows = [box.payloads(buf, BYTES, nbytes)[src] for buf in (0, 1)]
        self.compile("BROADCAST_ROOT" if self.root else "BROADCAST_LEAF", nbytes, root=src)

    def run(self, x: np.ndarray, seq: int) -> None:
        """x (flat, contiguous, of the prepared dtype and size) <- the root's x, as `broadcast`."""
        native = self.native
        if native is not None:
            buf = native.run(seq, x)
            if buf is None or (buf >= 0 and self.settled(buf, seq, x)):
                return
        data = x.view(np.uint8)
        if self.root:
            self.post(seq, data, self.rows)
        else:
            data[...] = self.rows[self.post(seq, None, self.rows)]


class ChunkedBroadcast:
    """A prepared mailbox broadcast past one slot (`policy.MAILBOX_BROADCAST_SLOTS`): a `SmallBroadcast` per chunk
    size of `broadcast_chunks`, run chunk by chunk under the call's one number (each chunk one mailbox round)."""

    __slots__ = ("box", "plan")

    def __init__(self, box: Mailbox, c: Call, nbytes: int, src: int, make_call: Callable[[int], Call]) -> None:
        self.box = box
        parts: dict[int, SmallBroadcast] = {}
        self.plan = [(s, e, parts.get(e - s) or parts.setdefault(e - s, SmallBroadcast(box, c, e - s, src, make_call)))
                     for s, e in broadcast_chunks(nbytes, box.payload_bytes)]
        """(start, end, prepared op) of each chunk of the bytes."""

    def run(self, x: np.ndarray, seq: int) -> None:
        """x (flat, contiguous, of the prepared dtype and size) <- the root's x, as `broadcast`."""
        data = x.view(np.uint8)
        for s, e, part in self.plan:
            part.run(data[s:e], seq)


def prepared_broadcast(box: Mailbox, c: Call, nbytes: int, src: int,
                       make_call: Callable[[int], Call]) -> SmallBroadcast | ChunkedBroadcast:
    """The prepared form of a mailbox broadcast of `nbytes`: in one round up to a slot, else in chunks."""
    if nbytes <= box.payload_bytes:
        return SmallBroadcast(box, c, nbytes, src, make_call)
    return ChunkedBroadcast(box, c, nbytes, src, make_call)


CHUNK_ALIGN = 4096
"""A chunked broadcast's chunks are whole 4 KiB blocks (but the last): the blocks the root's compiled post skips
when unchanged are the data's own."""


def broadcast_chunks(nbytes: int, slot: int) -> list[tuple[int, int]]:
    """The byte ranges (start, end) a broadcast of `nbytes` runs in through a mailbox of `slot` bytes of payload per
    rank (a multiple of CHUNK_ALIGN): as few as fit, of one size of whole blocks but the last."""
    if nbytes <= slot:
        return [(0, nbytes)]
    chunks = -(-nbytes // slot)
    per = -(-nbytes // chunks // CHUNK_ALIGN) * CHUNK_ALIGN  # at most `slot`: ceil(nbytes / chunks) <= slot
    return [(s, min(s + per, nbytes)) for s in range(0, nbytes, per)]


class SmallAllGather(Prepared):
    """A prepared mailbox all_gather (see `Prepared`): this rank's slot and every member's in both buffers, as
    bytes."""

    __slots__ = ("mine", "rows")

    def __init__(self, box: Mailbox, c: Call, x: np.ndarray, make_call: Callable[[int], Call]) -> None:
        super().__init__(box, c, make_call, x.nbytes)
        self.rows = [box.payloads(buf, BYTES, x.nbytes) for buf in (0, 1)]
        self.mine = [rows[box.rank] for rows in self.rows]
        self.compile("ALL_GATHER", box.size * x.nbytes)

    def run(self, out: np.ndarray, seq: int, x: np.ndarray | None = None) -> None:
        """out (size, ...; contiguous, of the prepared dtype and block size) <- every member's block, as
        `all_gather`: this rank's is `x`, or row `rank` of `out` already if `x` is None."""
        native = self.native
        if native is not None:
            buf = native.run(seq, out, x)
            if buf is None or (buf >= 0 and self.settled(buf, seq, out)):
                return
        if x is not None:
            if x.ndim:
                copy(out[self.box.rank], x)
            else:
                out[self.box.rank] = x
        rows = out.reshape(self.box.size, -1).view(np.uint8)
        rows[...] = self.rows[self.post(seq, rows[self.box.rank], self.mine)]


class SmallReduceScatter(Prepared):
    """A prepared mailbox reduce_scatter (see `Prepared`): this rank's slot and, in both buffers, every member's
    part `rank` of its input, the ufunc."""

    __slots__ = ("mine", "parts", "ufunc", "average")

    def __init__(self, box: Mailbox, c: Call, src: np.ndarray, per: int, op: ReduceOp,
                 make_call: Callable[[int], Call]) -> None:
        super().__init__(box, c, make_call, src.nbytes)
        views = [box.payloads(buf, src.dtype, src.size) for buf in (0, 1)]
        self.mine = [view[box.rank] for view in views]
        self.parts = [list(view[:, box.rank * per : (box.rank + 1) * per]) for view in views]
        self.ufunc: Callable[..., np.ndarray] = UFUNCS[op]
        self.average = op is ReduceOp.AVG
        self.compile("REDUCE_SCATTER", src.nbytes, dtype=src.dtype, op=op, count=per,
                     part=box.rank * per * src.dtype.itemsize, out_bytes=per * src.dtype.itemsize)

    def run(self, src: np.ndarray, out: np.ndarray, seq: int) -> None:
        """out (flat, contiguous) <- part `rank` of the reduction of every member's src (flat, contiguous, of the
        prepared dtype and size), as `reduce_scatter`."""
        native = self.native
        if native is not None:
            buf = native.run(seq, src, out)
            if buf is None or (buf >= 0 and self.settled(buf, seq, src, out)):
                return
        _reduce_listed(self.parts[self.post(seq, src, self.mine)], out, self.ufunc, self.average)


class SmallBarrier(Prepared):
    """A prepared mailbox barrier (see `Prepared`): a post without payload."""

    __slots__ = ()

    def __init__(self, box: Mailbox, c: Call, make_call: Callable[[int], Call]) -> None:
        super().__init__(box, c, make_call)
        self.compile("BARRIER", 0)

    def run(self, seq: int) -> None:
        native = self.native
        if native is not None:
            buf = native.run(seq)
            if buf is None or (buf >= 0 and self.settled(buf, seq)):
                return
        self.post(seq, None, [])


def broadcast(box: Mailbox, c: Call, x: np.ndarray, src: int) -> None:
    """x (flat, contiguous) <- the root's x, one mailbox round per chunk (`broadcast_chunks`)."""
    data = x.view(np.uint8)
    root = box.rank == src
    for s, e in broadcast_chunks(data.size, box.payload_bytes):
        buf = box.post(c, data[s:e] if root else None)
        if not root:
            data[s:e] = box.payloads(buf, BYTES, e - s)[src]


def all_gather(box: Mailbox, c: Call, out: np.ndarray) -> None:
    rows = out.reshape(box.size, -1).view(np.uint8)
    rows[...] = box.payloads(box.post(c, rows[box.rank]), BYTES, rows.shape[1])


def reduce_scatter(box: Mailbox, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    per = out.size
    parts = box.payloads(box.post(c, src), src.dtype, src.size)[:, box.rank * per : (box.rank + 1) * per]
    reduce_rows(parts, out, op)


def barrier(box: Mailbox, c: Call) -> None:
    box.post(c, None)
