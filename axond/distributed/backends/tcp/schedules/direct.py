"""One-round schedules: every rank sends each peer its block straight (all_gather, reduce-scatter, all-to-all,
gather, scatter)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axond.distributed.backends.host_copy import copy
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call, byte_view
from axond.distributed.backends.tcp.transport.wire import DTYPES, UNEVEN_ALL_TO_ALL, Kind, Op, dtype_code, uneven_aux
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average
from axond.distributed.backends.splits import offsets

META = 34
"""Max int64 words of a scatter metadata frame: dtype code, ndim, up to 32 dims."""
UNEVEN = UNEVEN_ALL_TO_ALL


def direct_all_gather(comm: GroupView, c: Call, out: np.ndarray) -> None:
    """out (size, ...) <- every rank's row, each sent straight to every other; row `rank` is already in place."""
    g, r, n = comm.g, comm.rank, comm.size
    mine = byte_view(out[r : r + 1])
    for k in range(1, n):
        g.send(c, (r + k) % n, mine)
    for k in range(1, n):
        src = (r - k) % n
        g.recv(c, src, byte_view(out[src : src + 1]))
    g.flush(c)


def exchange_all_gather(comm: GroupView, c: Call, out: np.ndarray) -> None:
    """As `direct_all_gather`, for blocks too big to be written inline: one non-blocking send/receive loop over every
    socket in this thread instead of through the sender threads."""
    r, n = comm.rank, comm.size
    mine = byte_view(out[r : r + 1])
    others = [p for p in range(n) if p != r]
    comm.g.exchange(c, dict.fromkeys(others, mine), {p: byte_view(out[p : p + 1]) for p in others})


def direct_reduce_scatter(comm: GroupView, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """Small reduce-scatter in one round: block d goes straight to rank d, which reduces in rank order."""
    g, r, n = comm.g, comm.rank, comm.size
    ufunc = UFUNCS[op]
    per = src.size // n
    for k in range(1, n):
        d = (r + k) % n
        g.send(c, d, byte_view(src[d * per : (d + 1) * per]))
    tmp = comm.scratch.receive(per * src.itemsize, src.dtype, per)
    for s in range(n):
        if s == r:
            block = src[r * per : (r + 1) * per]
        else:
            g.recv(c, s, byte_view(tmp))
            block = tmp
        if s == 0:
            copy(out, block)
        else:
            ufunc(out, block, out=out)
    if op is ReduceOp.AVG:
        finish_average(out, n)
    g.flush(c)


def gather(comm: GroupView, c: Call, x: np.ndarray, out: np.ndarray | None, dst: int) -> None:
    """out (on rank `dst`: (size, ...)) <- every rank's `x`, each sent straight to `dst`."""
    g = comm.g
    if out is None:
        g.wait_sent(c, dst, g.send(c, dst, byte_view(np.ascontiguousarray(x))))
        return
    out[dst] = x
    for p in range(comm.size):
        if p != dst:
            g.recv(c, p, byte_view(out[p : p + 1]))


def send_scattered(comm: GroupView, c: Call, x: np.ndarray, src: int) -> None:
    """From rank `src`: row p of contiguous `x` to rank p, after a frame with its dtype and shape."""
    g = comm.g
    meta = np.array([dtype_code(x.dtype), x.ndim - 1, *x.shape[1:]], np.int64)
    mc = g.call(Op.SCATTER, Kind.COLLECTIVE, 0, 0, c.seq, src, 0)
    for p in range(comm.size):
        if p != src:
            g.send(mc, p, byte_view(meta))
            g.send(c, p, byte_view(x[p : p + 1]))
    g.flush(c)


def receive_scattered(comm: GroupView, seq: int, src: int) -> np.ndarray:
    """This rank's row of scatter number `seq` from rank `src`, shaped as the metadata frame before it says."""
    g = comm.g
    mc = g.call(Op.SCATTER, Kind.COLLECTIVE, 0, 0, seq, src, 0)
    meta = np.zeros(META, np.int64)
    nbytes = g.expect(mc, src, None)
    if nbytes > meta.nbytes or nbytes < 16:
        raise g.error(mc, src, f"peer rank {src} sent {nbytes} bytes of scatter metadata")
    g.peers[src].recv_into(byte_view(meta)[:nbytes], mc.deadline)
    out = np.empty(tuple(int(d) for d in meta[2 : 2 + meta[1]]), DTYPES[int(meta[0]) - 1])
    c = g.call(Op.SCATTER, Kind.COLLECTIVE, int(meta[0]), 0, seq, src, out.size)
    g.recv(c, src, byte_view(out))
    return out


def all_to_all(comm: GroupView, c: Call, x: np.ndarray, out: np.ndarray, ins: Sequence[int],
               outs: Sequence[int]) -> None:
    """out <- block `rank` of every rank's contiguous `x`, rows split by `ins` (sent) and `outs` (received). With
    split sizes (c.aux UNEVEN), each frame carries its block's rows and those going the other way."""
    g, r, n = comm.g, comm.rank, comm.size
    src_at, dst_at = offsets(list(ins)), offsets(list(outs))
    copy(out[dst_at[r] : dst_at[r + 1]], x[src_at[r] : src_at[r + 1]])
    row = math.prod(x.shape[1:])

    def frame(count: int, back: int) -> Call:
        return g.resized(c, count * row, uneven_aux(back * row)) if c.aux == UNEVEN else c

    if n == 1:
        return
    for k in range(1, n):
        d = (r + k) % n
        g.send(frame(ins[d], outs[d]), d, byte_view(x[src_at[d] : src_at[d + 1]]))
    for k in range(1, n):
        src = (r - k) % n
        g.recv(frame(outs[src], ins[src]), src, byte_view(out[dst_at[src] : dst_at[src + 1]]))
    g.flush(c)
