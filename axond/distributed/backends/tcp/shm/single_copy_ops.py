"""The large collectives of a one-host group on the single-copy path (see `single_copy`): each rank publishes its
buffer, reads what it needs straight from its peers' buffers, and synchronizes once more before returning.

- all_gather: each rank reads the n - 1 other blocks straight into `out`.
- broadcast: the others read the root's buffer.
- reduce_scatter: rank r reads block r of every peer into scratch, a chunk at a time, and reduces in rank order.
- all_reduce: the same into part r of its own buffer (no peer reads that part in this phase), a synchronization,
  then every rank reads the other reduced parts from their owners.

Reductions run in rank order on one rank per part, so every rank gets the same numbers. Scratch stays bounded:
SINGLE_COPY_CHUNK_BYTES per peer. A peer's buffer from `shared_empty` is read from its mapping (a memcpy), and
reduced from it without the scratch.

A broadcast or all_gather of a shape that took the path through the mailbox once runs prepared after that
(`PreparedBroadcast`, `PreparedAllGather`): one C call (`_fastbox`) posts the publication, reads and posts again,
where every member runs the compiled ops.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.backends.host_copy import large_copy
from axond.distributed.backends.tcp.shm.mailbox_ops import Prepared
from axond.distributed.backends.tcp.policy import SINGLE_COPY_CHUNK_BYTES
from axond.distributed.backends.tcp.shm.single_copy import WORDS, SingleCopy
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average



def all_gather(sc: SingleCopy, c: Call, out: np.ndarray, x: np.ndarray | None = None) -> None:
    """out (size, ...) <- every rank's block; out[rank] already holds this rank's, unless `x` (C-contiguous, the
    block) is given: then the peers read x, and out[rank] is filled from it meanwhile."""
    r, n = sc.comm.rank, sc.comm.size
    rows = out.reshape(n, -1).view(np.uint8)
    table = sc.publish(c, rows[r] if x is None else x.reshape(-1).view(np.uint8))
    if x is not None:
        large_copy(rows[r], x.reshape(-1).view(np.uint8))
    for k in range(1, n):
        p = (r + k) % n  # start at a different peer on each rank
        sc.read(c, table, p, 0, rows[p])
    sc.done(c)


def broadcast(sc: SingleCopy, c: Call, x: np.ndarray, src: int) -> None:
    """x (flat, contiguous) <- the source rank's x."""
    data = x.view(np.uint8)
    table = sc.publish(c, data)
    if sc.comm.rank != src:
        sc.read(c, table, src, 0, data)
    sc.done(c)


def reduce_scatter(sc: SingleCopy, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out (flat) <- block `rank` of the reduction of every rank's `src` (flat, size x block elements)."""
    r, per = sc.comm.rank, out.size
    table = sc.publish(c, src)
    _reduce_part(sc, c, table, src, r * per, (r + 1) * per, out, op)
    sc.done(c)


def all_reduce(sc: SingleCopy, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """x (flat, contiguous) <- the reduction over ranks: each rank reduces its part in place, then reads the others'."""
    r, n = sc.comm.rank, sc.comm.size
    bounds = [x.size * k // n for k in range(n + 1)]
    table = sc.publish(c, x)
    lo, hi = bounds[r], bounds[r + 1]
    _reduce_part(sc, c, table, x, lo, hi, x[lo:hi], op)
    sc.sync(c)  # every part is reduced; from here on the owners only read
    for k in range(1, n):
        p = (r + k) % n
        if bounds[p + 1] > bounds[p]:
            sc.read(c, table, p, bounds[p] * x.itemsize, x[bounds[p] : bounds[p + 1]])
    sc.done(c)


def _reduce_part(sc: SingleCopy, c: Call, table: np.ndarray, mine: np.ndarray, lo: int, hi: int, dest: np.ndarray,
                 op: ReduceOp) -> None:
    """dest <- elements lo..hi of every rank's published buffer (this rank's: `mine`) reduced in rank order, a chunk
    at a time. `dest` may be mine[lo:hi]: each step writes it only once this rank's operand is used."""
    r, n = sc.comm.rank, sc.comm.size
    ufunc: Callable[..., np.ndarray] = UFUNCS[op]
    per = max(1, SINGLE_COPY_CHUNK_BYTES // mine.itemsize)
    scratch = sc.comm.scratch.named("single_copy", n * per * mine.itemsize, mine.dtype, n * per).reshape(n, per)
    for s in range(lo, hi, per):
        e = min(s + per, hi)
        m = e - s
        parts = [mine[s:e] if p == r else scratch[p, :m] for p in range(n)]
        for p in range(n):
            if p != r:
                mapped = sc.view(c, table, p, s * mine.itemsize, m * mine.itemsize)
                if mapped is not None:  # an array from shared_empty: reduced straight from the peer's memory
                    parts[p] = mapped.view(mine.dtype)
                else:
                    sc.read(c, table, p, s * mine.itemsize, parts[p])
        target, acc = dest[s - lo : e - lo], scratch[r, :m]
        prev = parts[0]
        for k in range(1, n):
            into = target if k >= r else acc  # this rank's operand (maybe `target`) is read at step r
            ufunc(prev, parts[k], out=into)
            prev = into
        if op is ReduceOp.AVG:
            finish_average(target, n)


class _PreparedSingleCopy(Prepared):
    """A single-copy op of one call shape in its compiled form (see `Prepared`; `_fastbox.SC_*`): its `run` is one C
    call where every member posts within the wait's first turns; otherwise `_rest` finishes it as the Python path
    does."""

    __slots__ = ("sc",)

    def __init__(self, sc: SingleCopy, c: Call, make_call: Callable[[int], Call]) -> None:
        assert sc.sync.mailbox is not None
        super().__init__(sc.sync.mailbox, c, make_call, WORDS * 8)
        self.sc = sc

    def _rest(self, code: int, seq: int, a: np.ndarray, b: np.ndarray | None) -> None:
        """After `native.run` returned `code` (not None, not -1): the publications (0, 1) or the last post (2, 3)
        in that buffer wait for a member; settle them as `Mailbox.settle` does (raising naming a late or mismatched
        peer), read and post the last time."""
        box = self.box
        if code < 2:
            box.settle(code, box.count.ops, self.posted, self.make_call, seq)
            self._native("finish", seq, code, a, b)
            box.post(self.make_call(seq), None)
        else:
            box.settle(code - 2, box.count.ops, 0, self.make_call, seq)

    def _native(self, method: str, seq: int, *args: object) -> int | None:
        """`native.run` or `native.finish`; a failed read raises `DistributedError` naming the peer."""
        try:
            result: int | None = getattr(self.native, method)(*args)
            return result
        except OSError as e:
            peer = self.native.failed
            raise self.box.g.error(self.make_call(seq), peer, f"reading peer rank {peer}'s buffer failed: "
                                                              f"{e.strerror} (did it die?)") from e


class PreparedBroadcast(_PreparedSingleCopy):
    """broadcast from group rank `src` on the single-copy path, prepared (see `_PreparedSingleCopy`)."""

    __slots__ = ("src",)

    def __init__(self, sc: SingleCopy, c: Call, x: np.ndarray, src: int, make_call: Callable[[int], Call]) -> None:
        super().__init__(sc, c, make_call)
        self.src = src
        self.compile("SC_BROADCAST", x.nbytes, root=src)

    def run(self, x: np.ndarray, seq: int) -> None:
        """x (flat, contiguous, of the prepared dtype and size) <- the root's x, as `broadcast`."""
        code = None if self.native is None else self._native("run", seq, seq, x)
        if self.native is None or code == -1:
            broadcast(self.sc, self.make_call(seq), x, self.src)
        elif code is not None:
            self._rest(code, seq, x, None)


class PreparedAllGather(_PreparedSingleCopy):
    """all_gather on the single-copy path, prepared (see `_PreparedSingleCopy`)."""

    __slots__ = ()

    def __init__(self, sc: SingleCopy, c: Call, x: np.ndarray, make_call: Callable[[int], Call]) -> None:
        super().__init__(sc, c, make_call)
        self.compile("SC_ALL_GATHER", sc.comm.size * x.nbytes)

    def run(self, out: np.ndarray, seq: int, x: np.ndarray | None = None) -> None:
        """out (size, ...; contiguous, of the prepared dtype and block size) <- every member's block, as
        `all_gather`: this rank's is `x`, or row `rank` of `out` already if `x` is None."""
        code = None if self.native is None else self._native("run", seq, seq, out, x)
        if self.native is None or code == -1:
            if x is not None and (not x.flags.c_contiguous or np.may_share_memory(x, out)):
                large_copy(out[self.sc.comm.rank], x)  # the peers read it from this rank's row instead
                x = None
            all_gather(self.sc, self.make_call(seq), out, x)
        elif code is not None:
            self._rest(code, seq, out, x)
