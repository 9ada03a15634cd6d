"""Pipelined ring schedules: reduce-scatter and all-gather around the ring in chunks, so that sending, receiving
and reducing overlap; a large all-reduce is one then the other (bandwidth-optimal: 2(n-1)/n of the data each way)."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends import chunking
from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call, byte_view
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average

Chunks = list[list[tuple[int, int]]]
"""Per block of the ring, its pipeline chunks as (start, end) element offsets."""


def chunks(comm: GroupView, count: int, itemsize: int) -> Chunks:
    block_bytes = -(-count // comm.size) * itemsize
    return chunking.block_chunks(count, comm.size, itemsize,
                                 policy.pipeline_chunk_bytes(block_bytes, comm.options))


def ring_reduce_scatter(comm: GroupView, c: Call, src: np.ndarray, work: np.ndarray | None, final: np.ndarray,
                        base: int, op: ReduceOp, blocks: Chunks, forward_final: bool) -> None:
    """Reduce blocks around the ring; this rank's block ends in `final` (offset `base`), optionally forwarded.

    Partial sums go into `work` at their own offsets (all-reduce passes the array itself), or, when
    `work` is None, into two block-sized halves of a scratch buffer used in turn: a half is reused
    two steps later, once the sends that read from it have left. So a reduce-scatter keeps two
    blocks of scratch (none with two ranks), not a copy of its input.
    """
    g, r, n = comm.g, comm.rank, comm.size
    ufunc = UFUNCS[op]
    right, left = (r + 1) % n, (r - 1) % n
    first, _ = chunking.ring_reduce_scatter_blocks(r, n, 0)
    for s, e in blocks[first]:
        g.send(c, right, byte_view(src[s:e]))
    biggest = max(e - s for blk in blocks for s, e in blk)
    tmp_all = comm.scratch.receive(biggest * src.itemsize, src.dtype, biggest)
    block = max(blk[-1][1] - blk[0][0] for blk in blocks)
    halves = comm.scratch.rolling(2 * block, src.dtype) if work is None and n > 2 else None
    sent: list[int] = []
    for step in range(n - 1):
        _, blk = chunking.ring_reduce_scatter_blocks(r, n, step)
        last = step == n - 2
        if halves is not None and not last and step >= 2:
            g.wait_sent(c, right, sent[step - 2])
        start = blocks[blk][0][0]
        ticket = 0
        for s, e in blocks[blk]:
            tmp = tmp_all[: e - s]
            g.recv(c, left, byte_view(tmp))
            if last:
                out = final[s - base : e - base]
            elif halves is not None:
                at = (step % 2) * block + s - start
                out = halves[at : at + e - s]
            else:
                assert work is not None
                out = work[s:e]
            ufunc(src[s:e], tmp, out=out)
            if last and op is ReduceOp.AVG:
                finish_average(out, n)
            if not last or forward_final:
                ticket = g.send(c, right, byte_view(out))
        sent.append(ticket)


def ring_all_gather(comm: GroupView, c: Call, x: np.ndarray, blocks: Chunks, post_own: bool) -> None:
    """Circulate blocks around the ring into `x`; this rank's block `rank` is already in place."""
    g, r, n = comm.g, comm.rank, comm.size
    right, left = (r + 1) % n, (r - 1) % n
    if post_own:
        for s, e in blocks[r]:
            g.send(c, right, byte_view(x[s:e]))
    for step in range(n - 1):
        _, blk = chunking.ring_all_gather_blocks(r, n, step)
        for s, e in blocks[blk]:
            view = x[s:e]
            g.recv(c, left, byte_view(view))
            if step < n - 2:
                g.send(c, right, byte_view(view))
    g.flush(c, right)


def ring_all_reduce(comm: GroupView, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    blocks = chunks(comm, x.size, x.itemsize)
    ring_reduce_scatter(comm, c, x, x, x, 0, op, blocks, forward_final=True)
    ring_all_gather(comm, c, x, blocks, post_own=False)


def ring_reduce_scatter_into(comm: GroupView, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out (flat) <- block `rank` of the reduction of flat `src`, around the ring; `src` is not modified."""
    ring_reduce_scatter(comm, c, src, None, out, comm.rank * (src.size // comm.size), op,
                        chunks(comm, src.size, src.itemsize), False)
    comm.g.flush(c)


def ring_all_gather_rows(comm: GroupView, c: Call, out: np.ndarray) -> None:
    """out (size, ...) <- every rank's row around the ring; row `rank` is already in place."""
    flat = out.reshape(-1)
    ring_all_gather(comm, c, flat, chunks(comm, flat.size, flat.itemsize), True)
