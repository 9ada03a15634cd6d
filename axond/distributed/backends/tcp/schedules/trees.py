"""Rooted schedules: binomial-tree broadcast (small) and reduce, and a pipelined chain broadcast (large)."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends import chunking
from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call, byte_view
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average


def tree_broadcast(comm: GroupView, c: Call, x: np.ndarray, src: int) -> None:
    g, v = comm.g, (comm.rank - src) % comm.size
    xb = byte_view(x)
    parent = chunking.binomial_parent(v)
    if parent is not None:
        g.recv(c, comm.real(parent, src), xb)
    children = [comm.real(ch, src) for ch in chunking.binomial_children(v, comm.size)]
    for ch in children:
        g.send(c, ch, xb)
    g.flush(c, *children)


def chain_broadcast(comm: GroupView, c: Call, x: np.ndarray, src: int) -> None:
    g, n, v = comm.g, comm.size, (comm.rank - src) % comm.size
    nchunks = chunking.chunk_count(x.nbytes, policy.pipeline_chunk_bytes(x.nbytes // 4, comm.options))
    nxt = comm.real(v + 1, src) if v < n - 1 else None
    prev = comm.real(v - 1, src) if v > 0 else None
    for s, e in chunking.split_even(x.size, nchunks):
        view = byte_view(x[s:e])
        if prev is not None:
            g.recv(c, prev, view)
        if nxt is not None:
            g.send(c, nxt, view)
    if nxt is not None:
        g.flush(c, nxt)


def tree_reduce(comm: GroupView, c: Call, x: np.ndarray, dst: int, op: ReduceOp) -> None:
    g, v = comm.g, (comm.rank - dst) % comm.size
    ufunc = UFUNCS[op]
    children = chunking.binomial_children(v, comm.size)
    if children:
        tmp = comm.scratch.receive(x.nbytes, x.dtype, x.size)
        for ch in children:
            g.recv(c, comm.real(ch, dst), byte_view(tmp))
            ufunc(x, tmp, out=x)
    parent = chunking.binomial_parent(v)
    if parent is not None:
        p = comm.real(parent, dst)
        g.wait_sent(c, p, g.send(c, p, byte_view(x)))
    elif op is ReduceOp.AVG:
        finish_average(x, comm.size)
