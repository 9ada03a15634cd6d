"""The algorithms of the TCP backend, each a short function over `FramedGroup` sends and receives.

Small all-reduces use recursive doubling (extra ranks of non-power-of-two groups fold in first and
get the result back); large ones a ring reduce-scatter + all-gather pipelined in chunks, so that
sending, receiving and reducing overlap. Broadcast is a binomial tree when small and a pipelined
chain when large; reduce is a binomial tree. On power-of-two groups the pairwise variants (halving-
doubling all-reduce, recursive-halving reduce-scatter, recursive-doubling all-gather) serve hosts with
more ranks than cores; `TcpBackend` picks by size and core count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed import chunking
from axond.distributed.framing import Call, FramedGroup, TcpTuning, byte_view
from axond.distributed.peer import SMALL_FRAME
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import UFUNCS, finish_average

CROWDED_DOUBLING_BYTES = 256 << 10
"""With more ranks than cores on a power-of-two group, all-reduces up to this size use recursive doubling..."""
CROWDED_HALVING_BYTES = 2 << 20
"""...and up to this size halving-doubling: log2(n) pairwise steps keep the cores busier than a ring's
n-1 dependent ones (bench busbw at n = 4 on 2 cores: 1.3-1.6x the ring's from 256 KiB to 2 MiB, no gain at 4 MiB)."""
DIRECT_ALL_GATHER_BYTES = 4 << 20
"""Output size up to which all_gather sends every block straight to every peer instead of around a ring."""
CROWDED_TREE_BROADCAST_BYTES = 4 << 20
"""With more ranks than cores, broadcasts up to this size use the binomial tree, not the pipelined chain: the
same bytes in fewer, larger frames and a shallower critical path (A/B on 2 cores: 1.3-1.5x at 1 MiB and
1.2-1.4x at 4 MiB with 3 and 4 ranks; the chain wins from 16 MiB)."""
PAIR_ONE_ROUND_BYTES = 1 << 20
"""With two ranks, all_reduce, broadcast and reduce_scatter up to this size send one frame each way (recursive
doubling, one send, one direct round) instead of a pipelined ring or chain: two ranks have one hop, so the
chunks only add calls (interleaved A/B at n = 2: 1.3-1.6x at 256 KiB, 1.05-1.6x at 1 MiB; the ring wins from 2 MiB)."""


class TcpAlgorithms:
    """Mixed into `TcpBackend`: the schedules, independent of argument checking and op bookkeeping."""

    g: FramedGroup
    rank: int
    size: int
    tuning: TcpTuning
    crowded: bool
    """Whether this host's ranks outnumber its cores (see `peer.oversubscribed`)."""
    _scratch: Callable[[int, np.dtype, int], np.ndarray]
    """The backend's reusable receive buffer: (nbytes, dtype, count) -> a typed view of it."""
    _rolling: Callable[[int, np.dtype], np.ndarray]
    """The backend's reusable buffer for forwarded partial sums: (count, dtype) -> a typed array of `count`."""

    def _all_reduce_algorithm(self, nbytes: int) -> str:
        """Recursive doubling up to `small_bytes` (auto with two ranks: PAIR_ONE_ROUND_BYTES); above, the configured
        algorithm (auto: see `TcpTuning.algorithm`)."""
        algo, pow2 = self.tuning.algorithm, self.size & (self.size - 1) == 0
        if nbytes <= self.tuning.small_bytes or (algo == "auto" and self._pair_round(nbytes)):
            return "doubling"
        if algo == "auto" and pow2 and self.crowded:
            if nbytes <= CROWDED_DOUBLING_BYTES:
                return "doubling"
            return "halving_doubling" if nbytes <= CROWDED_HALVING_BYTES else "ring"
        return "halving_doubling" if algo == "halving_doubling" and pow2 else "ring"

    def _pair_round(self, nbytes: int) -> bool:
        """Whether a two-rank group moves `nbytes` in one round (see PAIR_ONE_ROUND_BYTES)."""
        return self.size == 2 and nbytes <= PAIR_ONE_ROUND_BYTES

    def _all_reduce_flat(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        """All-reduce of flat contiguous `x` over the sockets, by the algorithm its size calls for."""
        if self.size == 1:
            return
        algo = self._all_reduce_algorithm(x.nbytes)
        if algo == "doubling":
            self._recursive_doubling(c, x, op)
        elif algo == "halving_doubling":
            self._halving_doubling(c, x, op)
        else:
            self._ring_all_reduce(c, x, op)

    def _broadcast_by_tree(self, nbytes: int) -> bool:
        """Binomial tree up to `small_bytes` (two ranks: PAIR_ONE_ROUND_BYTES; more ranks than cores:
        CROWDED_TREE_BROADCAST_BYTES); above, the pipelined chain."""
        return (nbytes <= self.tuning.small_bytes or self._pair_round(nbytes)
                or (self.crowded and nbytes <= CROWDED_TREE_BROADCAST_BYTES))

    def _broadcast_flat(self, c: Call, x: np.ndarray, src: int) -> None:
        """Broadcast of flat contiguous `x` from `src` over the sockets."""
        if self.size > 1:
            (self._tree_broadcast if self._broadcast_by_tree(x.nbytes) else self._chain_broadcast)(c, x, src)

    def _all_gather_algorithm(self, nbytes: int) -> str:
        """Up to DIRECT_ALL_GATHER_BYTES (and always with two ranks) each block goes straight to every peer as
        one frame: the bytes of a ring in one round. Above, a pipelined ring; on power-of-two groups whose host
        has fewer cores than ranks, recursive doubling (log2(n) pairwise swaps, no sender-thread hand-offs)."""
        if self.size == 1:
            return "none"
        if self.size == 2 or nbytes <= DIRECT_ALL_GATHER_BYTES:
            return "direct"
        if self.crowded and self.size & (self.size - 1) == 0 and self.tuning.algorithm == "auto":
            return "doubling"
        return "ring"

    def _all_gather_flat(self, c: Call, out: np.ndarray) -> None:
        """All-gather over the sockets into contiguous `out` (size, ...), whose row `rank` is this rank's block."""
        algo = self._all_gather_algorithm(out.nbytes)
        if algo == "direct":
            self._direct_all_gather(c, out)
        elif algo == "doubling":
            self._doubling_all_gather(c, out)
        elif algo == "ring":
            flat = out.reshape(-1)
            self._ring_all_gather(c, flat, self._chunks(flat.size, flat.itemsize), True)

    def _reduce_scatter_algorithm(self, nbytes: int) -> str:
        """One direct round up to `small_bytes` (with two ranks, PAIR_ONE_ROUND_BYTES); above, recursive
        halving wherever all_reduce would use halving-doubling (its first half), else the pipelined ring."""
        if nbytes <= self.tuning.small_bytes or self._pair_round(nbytes):
            return "direct"
        return "halving" if self._all_reduce_algorithm(nbytes) == "halving_doubling" else "ring"

    def _reduce_scatter_flat(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """Reduce-scatter over the sockets: flat `out` <- block `rank` of the reduction of flat `src` (size blocks)."""
        if self.size == 1:
            np.copyto(out, src)
            if op is ReduceOp.AVG:
                finish_average(out, 1)
            return
        algo = self._reduce_scatter_algorithm(src.nbytes)
        if algo == "direct":
            self._direct_reduce_scatter(c, src, out, op)
        elif algo == "halving":
            self._halving_reduce_scatter(c, src, out, op)
        else:
            self._ring_reduce_scatter(c, src, None, out, self.rank * (src.size // self.size), op,
                                      self._chunks(src.size, src.itemsize), False)
            self.g.flush(c)

    def _recursive_doubling(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        g, r, n = self.g, self.rank, self.size
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
            tmp = self._scratch(x.nbytes, x.dtype, x.size)
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

    def _chunks(self, count: int, itemsize: int) -> list[list[tuple[int, int]]]:
        block_bytes = -(-count // self.size) * itemsize
        return chunking.block_chunks(count, self.size, itemsize,
                                     chunking.pipeline_chunk_bytes(block_bytes, self.tuning.chunk_bytes))

    def _ring_reduce_scatter(self, c: Call, src: np.ndarray, work: np.ndarray | None, final: np.ndarray, base: int,
                             op: ReduceOp, chunks: list[list[tuple[int, int]]], forward_final: bool) -> None:
        """Reduce blocks around the ring; this rank's block ends in `final` (offset `base`), optionally forwarded.

        Partial sums go into `work` at their own offsets (all-reduce passes the array itself), or, when
        `work` is None, into two block-sized halves of a scratch buffer used in turn: a half is reused
        two steps later, once the sends that read from it have left. So a reduce-scatter keeps two
        blocks of scratch (none with two ranks), not a copy of its input.
        """
        g, r, n = self.g, self.rank, self.size
        ufunc = UFUNCS[op]
        right, left = (r + 1) % n, (r - 1) % n
        first, _ = chunking.ring_reduce_scatter_blocks(r, n, 0)
        for s, e in chunks[first]:
            g.send(c, right, byte_view(src[s:e]))
        biggest = max(e - s for blk in chunks for s, e in blk)
        tmp_all = self._scratch(biggest * src.itemsize, src.dtype, biggest)
        block = max(blk[-1][1] - blk[0][0] for blk in chunks)
        halves = self._rolling(2 * block, src.dtype) if work is None and n > 2 else None
        sent: list[int] = []
        for step in range(n - 1):
            _, blk = chunking.ring_reduce_scatter_blocks(r, n, step)
            last = step == n - 2
            if halves is not None and not last and step >= 2:
                g.wait_sent(c, right, sent[step - 2])
            start = chunks[blk][0][0]
            ticket = 0
            for s, e in chunks[blk]:
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

    def _ring_all_gather(self, c: Call, x: np.ndarray, chunks: list[list[tuple[int, int]]], post_own: bool) -> None:
        """Circulate blocks around the ring into `x`; this rank's block `rank` is already in place."""
        g, r, n = self.g, self.rank, self.size
        right, left = (r + 1) % n, (r - 1) % n
        if post_own:
            for s, e in chunks[r]:
                g.send(c, right, byte_view(x[s:e]))
        for step in range(n - 1):
            _, blk = chunking.ring_all_gather_blocks(r, n, step)
            for s, e in chunks[blk]:
                view = x[s:e]
                g.recv(c, left, byte_view(view))
                if step < n - 2:
                    g.send(c, right, byte_view(view))
        g.flush(c, right)

    def _doubling_all_gather(self, c: Call, out: np.ndarray) -> None:
        """Recursive-doubling all_gather for power-of-two groups: log2(n) pairwise swaps of 1, 2, 4... blocks.

        Each swap is one `exchange`: this thread writes and reads both directions without the sender
        threads, so a crowded host sees no thread hand-offs (the ring's n-1 dependent steps each wake one).
        """
        g, r, n = self.g, self.rank, self.size
        m = 1
        while m < n:
            mine, theirs = r & ~(m - 1), (r & ~(m - 1)) ^ m
            g.exchange(c, {r ^ m: byte_view(out[mine : mine + m])}, {r ^ m: byte_view(out[theirs : theirs + m])})
            m <<= 1

    def _pieces(self, lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
        nbytes = (hi - lo) * itemsize
        n = chunking.chunk_count(nbytes, chunking.pipeline_chunk_bytes(nbytes, self.tuning.chunk_bytes))
        return [(lo + a, lo + b) for a, b in chunking.split_even(hi - lo, n)]

    def _split(self, mask: int, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The halves of [lo, hi) this rank keeps and gives to partner rank ^ mask in a recursive-halving step."""
        mid = lo + (hi - lo) // 2
        return ((lo, mid), (mid, hi)) if self.rank & mask == 0 else ((mid, hi), (lo, mid))

    def _halve(self, c: Call, op: ReduceOp, partner: int, keep: tuple[int, int], give: tuple[int, int],
               cur: np.ndarray, base: int, out: np.ndarray, obase: int) -> None:
        """One recursive-halving step: send `give` to `partner`, reduce its `keep` into `out`.

        `cur[i - base]` holds element i of the partial sums so far, `out[i - obase]` receives it.
        """
        g = self.g
        for s, e in self._pieces(*give, cur.itemsize):
            g.send(c, partner, byte_view(cur[s - base : e - base]))
        pieces = self._pieces(*keep, cur.itemsize)
        biggest = max(e - s for s, e in pieces)
        tmp_all = self._scratch(biggest * cur.itemsize, cur.dtype, biggest)
        ufunc = UFUNCS[op]
        for s, e in pieces:
            tmp = tmp_all[: e - s]
            g.recv(c, partner, byte_view(tmp))
            ufunc(cur[s - base : e - base], tmp, out=out[s - obase : e - obase])

    def _halving_doubling(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        """Rabenseifner all-reduce for power-of-two sizes: pairwise halving reduce-scatter, then doubling all-gather.

        Same bytes as the ring but log2(n) pairwise steps, so a descheduled rank stalls one partner, not the ring.
        """
        g, r, n = self.g, self.rank, self.size
        lo, hi = 0, x.size
        ranges = []
        mask = n >> 1
        while mask:
            keep, give = self._split(mask, lo, hi)
            self._halve(c, op, r ^ mask, keep, give, x, 0, x, 0)
            ranges.append((r ^ mask, keep, give))
            lo, hi = keep
            mask >>= 1
        if op is ReduceOp.AVG:
            finish_average(x[lo:hi], n)
        for partner, keep, give in reversed(ranges):
            for s, e in self._pieces(*keep, x.itemsize):
                g.send(c, partner, byte_view(x[s:e]))
            for s, e in self._pieces(*give, x.itemsize):
                g.recv(c, partner, byte_view(x[s:e]))
        g.flush(c)

    def _halving_reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """Recursive-halving reduce-scatter for power-of-two sizes: log2(n) pairwise steps, each halving the range.

        Step k's partial sums go to their own part of one scratch buffer (n/2 + n/4 + ... blocks), the last
        step's into `out`, so no step writes what an earlier step's sends still read; `src` is not modified.
        """
        n = self.size
        scratch = self._rolling(max(src.size - 2 * (src.size // n), 0), src.dtype)  # n/2 + n/4 + ... + 2 blocks
        used = 0
        lo, hi, cur, base = 0, src.size, src, 0
        mask = n >> 1
        while mask:
            keep, give = self._split(mask, lo, hi)
            if mask == 1:
                dest = out
            else:
                dest = scratch[used : used + keep[1] - keep[0]]
                used += keep[1] - keep[0]
            self._halve(c, op, self.rank ^ mask, keep, give, cur, base, dest, keep[0])
            (lo, hi), cur, base = keep, dest, keep[0]
            mask >>= 1
        if op is ReduceOp.AVG:
            finish_average(out, n)
        self.g.flush(c)

    def _ring_all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        chunks = self._chunks(x.size, x.itemsize)
        self._ring_reduce_scatter(c, x, x, x, 0, op, chunks, forward_final=True)
        self._ring_all_gather(c, x, chunks, post_own=False)

    def _real(self, vrank: int, root: int) -> int:
        return (vrank + root) % self.size

    def _tree_broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        g, v = self.g, (self.rank - src) % self.size
        xb = byte_view(x)
        parent = chunking.binomial_parent(v)
        if parent is not None:
            g.recv(c, self._real(parent, src), xb)
        children = [self._real(ch, src) for ch in chunking.binomial_children(v, self.size)]
        for ch in children:
            g.send(c, ch, xb)
        g.flush(c, *children)

    def _chain_broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        g, n, v = self.g, self.size, (self.rank - src) % self.size
        nchunks = chunking.chunk_count(x.nbytes, chunking.pipeline_chunk_bytes(x.nbytes // 4, self.tuning.chunk_bytes))
        nxt = self._real(v + 1, src) if v < n - 1 else None
        prev = self._real(v - 1, src) if v > 0 else None
        for s, e in chunking.split_even(x.size, nchunks):
            view = byte_view(x[s:e])
            if prev is not None:
                g.recv(c, prev, view)
            if nxt is not None:
                g.send(c, nxt, view)
        if nxt is not None:
            g.flush(c, nxt)

    def _tree_reduce(self, c: Call, x: np.ndarray, dst: int, op: ReduceOp) -> None:
        g, v = self.g, (self.rank - dst) % self.size
        ufunc = UFUNCS[op]
        children = chunking.binomial_children(v, self.size)
        if children:
            tmp = self._scratch(x.nbytes, x.dtype, x.size)
            for ch in children:
                g.recv(c, self._real(ch, dst), byte_view(tmp))
                ufunc(x, tmp, out=x)
        parent = chunking.binomial_parent(v)
        if parent is not None:
            p = self._real(parent, dst)
            g.wait_sent(c, p, g.send(c, p, byte_view(x)))
        elif op is ReduceOp.AVG:
            finish_average(x, self.size)

    def _direct_all_gather(self, c: Call, out: np.ndarray) -> None:
        """Every rank sends its block straight to every other: one round, no ring chain.

        Blocks too big to be written inline move in one non-blocking send/receive loop over every
        socket in this thread instead of through the sender threads.
        """
        g, r, n = self.g, self.rank, self.size
        mine = byte_view(out[r : r + 1])
        if mine.nbytes > self.tuning.inline_bytes:
            others = [p for p in range(n) if p != r]
            g.exchange(c, dict.fromkeys(others, mine), {p: byte_view(out[p : p + 1]) for p in others})
            return
        for k in range(1, n):
            g.send(c, (r + k) % n, mine)
        for k in range(1, n):
            src = (r - k) % n
            g.recv(c, src, byte_view(out[src : src + 1]))
        g.flush(c)

    def _direct_reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """Small reduce-scatter in one round: block d goes straight to rank d, which reduces in rank order."""
        g, r, n = self.g, self.rank, self.size
        ufunc = UFUNCS[op]
        per = src.size // n
        for k in range(1, n):
            d = (r + k) % n
            g.send(c, d, byte_view(src[d * per : (d + 1) * per]))
        tmp = self._scratch(per * src.itemsize, src.dtype, per)
        for s in range(n):
            if s == r:
                block = src[r * per : (r + 1) * per]
            else:
                g.recv(c, s, byte_view(tmp))
                block = tmp
            if s == 0:
                np.copyto(out, block)
            else:
                ufunc(out, block, out=out)
        if op is ReduceOp.AVG:
            finish_average(out, n)
        g.flush(c)
