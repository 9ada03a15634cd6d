"""Pairwise schedules: recursive doubling (small all-reduces, and power-of-two all_gathers), halving-doubling
(Rabenseifner) all-reduce and recursive-halving reduce-scatter. log2(n) pairwise steps keep an oversubscribed host's
cores busier than a ring's n-1 dependent ones; extra ranks of non-power-of-two groups fold in first."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends import chunking
from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call, byte_view
from axond.distributed.backends.tcp.policy import SMALL_FRAME
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average


def recursive_doubling(comm: GroupView, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """x (flat, contiguous) <- the reduction over the group, in log2(n) rounds of one frame each way."""
    g, r, n = comm.g, comm.rank, comm.size
    ufunc = UFUNCS[op]
    p2 = chunking.largest_power_of_two(n)
    xb = byte_view(x)
    if r >= p2:
        g.wait_sent(c, r - p2, g.send(c, r - p2, xb))
        g.recv(c, r - p2, xb)
        return
    if x.nbytes <= SMALL_FRAME:  # reduce straight from the peer's receive buffer: no copy, no scratch
        def receive(peer: int) -> np.ndarray:
            return g.recv_array(c, peer, x)
    else:
        tmp = comm.scratch.receive(x.nbytes, x.dtype, x.size)
        tb = byte_view(tmp)

        def receive(peer: int) -> np.ndarray:
            g.recv(c, peer, tb)
            return tmp
    if r + p2 < n:
        ufunc(x, receive(r + p2), out=x)
    mask, header, peers = 1, g.header(c, xb.nbytes), g.peers
    while mask < p2:
        partner = r ^ mask
        peer = peers[partner]
        ticket = peer.send(header, xb)
        got = receive(partner)
        peer.wait_sent(ticket, c.deadline)
        ufunc(x, got, out=x)
        mask <<= 1
    if op is ReduceOp.AVG:
        finish_average(x, n)
    if r + p2 < n:
        g.wait_sent(c, r + p2, g.send(c, r + p2, xb))


def doubling_all_gather(comm: GroupView, c: Call, out: np.ndarray) -> None:
    """Recursive-doubling all_gather for power-of-two groups: log2(n) pairwise swaps of 1, 2, 4... blocks.

    Each swap is one `exchange`: this thread writes and reads both directions without the sender
    threads, so an oversubscribed host sees no thread hand-offs (the ring's n-1 dependent steps each wake one).
    """
    g, r, n = comm.g, comm.rank, comm.size
    m = 1
    while m < n:
        mine, theirs = r & ~(m - 1), (r & ~(m - 1)) ^ m
        g.exchange(c, {r ^ m: byte_view(out[mine : mine + m])}, {r ^ m: byte_view(out[theirs : theirs + m])})
        m <<= 1


def _pieces(comm: GroupView, lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    nbytes = (hi - lo) * itemsize
    n = chunking.chunk_count(nbytes, policy.pipeline_chunk_bytes(nbytes, comm.options))
    return [(lo + a, lo + b) for a, b in chunking.split_even(hi - lo, n)]


def _split(rank: int, mask: int, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The halves of [lo, hi) this rank keeps and gives to partner rank ^ mask in a recursive-halving step."""
    mid = lo + (hi - lo) // 2
    return ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))


def _halve(comm: GroupView, c: Call, op: ReduceOp, partner: int, keep: tuple[int, int], give: tuple[int, int],
           cur: np.ndarray, base: int, out: np.ndarray, obase: int) -> None:
    """One recursive-halving step: send `give` to `partner`, reduce its `keep` into `out`.

    `cur[i - base]` holds element i of the partial sums so far, `out[i - obase]` receives it.
    """
    g = comm.g
    for s, e in _pieces(comm, *give, cur.itemsize):
        g.send(c, partner, byte_view(cur[s - base : e - base]))
    pieces = _pieces(comm, *keep, cur.itemsize)
    biggest = max(e - s for s, e in pieces)
    tmp_all = comm.scratch.receive(biggest * cur.itemsize, cur.dtype, biggest)
    ufunc = UFUNCS[op]
    for s, e in pieces:
        tmp = tmp_all[: e - s]
        g.recv(c, partner, byte_view(tmp))
        ufunc(cur[s - base : e - base], tmp, out=out[s - obase : e - obase])


def halving_doubling(comm: GroupView, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """Rabenseifner all-reduce for power-of-two sizes: pairwise halving reduce-scatter, then doubling all-gather.

    Same bytes as the ring but log2(n) pairwise steps, so a descheduled rank stalls one partner, not the ring.
    """
    g, r, n = comm.g, comm.rank, comm.size
    lo, hi = 0, x.size
    ranges = []
    mask = n >> 1
    while mask:
        keep, give = _split(r, mask, lo, hi)
        _halve(comm, c, op, r ^ mask, keep, give, x, 0, x, 0)
        ranges.append((r ^ mask, keep, give))
        lo, hi = keep
        mask >>= 1
    if op is ReduceOp.AVG:
        finish_average(x[lo:hi], n)
    for partner, keep, give in reversed(ranges):
        for s, e in _pieces(comm, *keep, x.itemsize):
            g.send(c, partner, byte_view(x[s:e]))
        for s, e in _pieces(comm, *give, x.itemsize):
            g.recv(c, partner, byte_view(x[s:e]))
    g.flush(c)


def halving_reduce_scatter(comm: GroupView, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """Recursive-halving reduce-scatter for power-of-two sizes: log2(n) pairwise steps, each halving the range.

    Step k's partial sums go to their own part of one scratch buffer (n/2 + n/4 + ... blocks), the last
    step's into `out`, so no step writes what an earlier step's sends still read; `src` is not modified.
    """
    n = comm.size
    scratch = comm.scratch.rolling(max(src.size - 2 * (src.size // n), 0), src.dtype)  # n/2 + n/4 + ... + 2 blocks
    used = 0
    lo, hi, cur, base = 0, src.size, src, 0
    mask = n >> 1
    while mask:
        keep, give = _split(comm.rank, mask, lo, hi)
        if mask == 1:
            dest = out
        else:
            dest = scratch[used : used + keep[1] - keep[0]]
            used += keep[1] - keep[0]
        _halve(comm, c, op, comm.rank ^ mask, keep, give, cur, base, dest, keep[0])
        (lo, hi), cur, base = keep, dest, keep[0]
        mask >>= 1
    if op is ReduceOp.AVG:
        finish_average(out, n)
    comm.g.flush(c)
