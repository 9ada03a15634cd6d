"""Small collectives of ranks on one node through a shared-memory mailbox: one round, no system calls.

Over loopback every small op costs a send and a receive per round, and on a host with more ranks than
cores the kernel's wake-ups between them are most of its latency. The mailbox is a tiny arena (two
buffers of one slot per rank: a sequence word, the op's frame header, up to MAILBOX_BYTES of payload).
A small all_reduce, broadcast, all_gather, reduce_scatter or barrier writes this rank's payload and
header into its slot, then its sequence number; it waits until every member's sequence number reaches
the op's, compares their headers with its own (a peer in another op, dtype or size raises on every
rank, naming both calls, as on sockets), and reads what it needs from their slots. Reductions run in
rank order, as everywhere.

- **Reuse:** consecutive mailbox ops alternate buffers, and a rank writes op m + 2 only after op m + 1
  saw every member's sequence number, i.e. after every member finished reading op m.
- **Waiting:** spinning, yielding the CPU (`sched_yield`) on each turn, so a crowded host runs the peers
  instead. After SPIN_SECONDS the wait sleeps on the group's sockets instead, re-checking every
  SLEEP_SECONDS.
- **Failures:** every CHECK_SECONDS of spinning (and on every wake-up after that) the wait looks at the
  group's sockets. There an abort frame, a closed connection (a dead peer), or a frame of some other op
  (a peer that called something else) raises as on sockets, and the deadline raises a timeout naming
  the first member that is missing.
- **A peer waiting on the sockets:** a rank in a larger op that waits for a frame from a member that is in
  a mailbox op instead (or for it to read one) would wait until the timeout, and so would that member. So
  while a group has a mailbox, every wake-up of a wait on its sockets (every RECV_WAKEUP) looks at the
  members' slots: one that posted the mailbox op this rank would run next, under the number of the op
  this rank runs now, called something else, and this rank raises (the member then sees its abort frame).
- **Point-to-point frames** that a member sent before it posted are set aside for their receives (see
  `FramedGroup.only_early`), not taken for another call.
- **The arena's steps** synchronize through the mailbox too: a post without payload (`TcpBackend._sync`).
- **Memory order:** payload, then sequence number: an x86 store order that every x86 core observes in
  that order (TSO). Other architectures keep small ops on the sockets.
"""

from __future__ import annotations

import os
import platform
import select
import struct
import time
from collections.abc import Callable

import numpy as np

from axond.distributed.framing import Call, FramedGroup
from axond.distributed.peer import PeerTimeout
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import UFUNCS, finish_average
from axond.distributed.shm import ShmArena
from axond.distributed.wire import Kind

MAILBOX_BYTES = 4096
"""Largest payload per rank that goes through the mailbox (all_gather: one block; reduce_scatter: the input)."""
HEAD_WORDS = 16
"""int64 words before the payload: the sequence number, then the op's 9 header fields."""
SLOT_BYTES = HEAD_WORDS * 8 + MAILBOX_BYTES
SPIN_SECONDS = 0.01
"""How long a wait spins before it sleeps on the sockets instead."""
CHECK_SECONDS = 0.0005
"""How often a spinning wait looks at the sockets for aborts, dead peers and mismatched calls."""
SLEEP_SECONDS = 0.001
"""How often a sleeping wait re-checks the mailbox (it wakes at once on anything arriving on a socket)."""
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""Whether stores become visible to other cores in program order (x86's TSO), which the mailbox relies on."""


def arena_bytes(size: int) -> int:
    """The `ShmArena` size whose slots are SLOT_BYTES: two buffers of size + 1 slots."""
    return 2 * (size + 1) * SLOT_BYTES


SAME_SETTINGS = "set AXOND_SHM and AXOND_SHM_MAILBOX alike on every rank"


HEAD = struct.Struct("<9q")
"""Words 1-9 of a slot: the op's header fields (`Call.expect`) and the payload's size."""


class Mailbox:
    """A group's mapped mailbox, with the offsets and views every op reuses (small ops are mostly overhead)."""

    def __init__(self, arena: ShmArena, rank: int, size: int) -> None:
        assert arena.chunk == SLOT_BYTES and arena.size == size
        self.arena = arena
        self.raw = arena.buffer()
        self.words = self.raw.cast("q")
        self.rank, self.size = rank, size
        self.base = [[(b * (size + 1) + p) * SLOT_BYTES for p in range(size)] for b in (0, 1)]
        """Byte offset of each rank's slot in each buffer."""
        self.others = [p for p in range(size) if p != rank]
        self.peer_seqs = [[(self.base[b][p] // 8, p) for p in self.others] for b in (0, 1)]
        """(index in `words` of the sequence word, rank) of each peer's slot in each buffer."""
        self._payloads: dict[tuple[int, np.dtype, int], np.ndarray] = {}

    def payloads(self, buf: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Every rank's payload in buffer `buf` as a (size, count) array of `dtype` (cached)."""
        key = (buf, dtype, count)
        view = self._payloads.get(key)
        if view is None:
            if len(self._payloads) >= 64:
                self._payloads.clear()
            slots = self.arena.slots(buf, np.dtype(np.uint8), SLOT_BYTES)
            view = self._payloads[key] = slots[:, HEAD_WORDS * 8 : HEAD_WORDS * 8 + count * dtype.itemsize].view(dtype)
        return view

    def close(self) -> None:
        self._payloads.clear()
        self.words.release()
        self.raw.release()
        self.arena.close()


class MailboxAlgorithms:
    """Mixed into `TcpBackend`: the one-round small collectives over a group's mailbox."""

    g: FramedGroup
    rank: int
    size: int
    _mailbox_ops: int
    """Mailbox ops run so far in this group: the next one's sequence number minus one."""
    _mailbox: Mailbox | None

    def _post(self, c: Call, box: Mailbox, payload: np.ndarray | None) -> int:
        """Write `payload` (flat, contiguous, or None) to this rank's slot and wait for every member's slot of
        this op; returns the buffer the op used (its payloads stay valid until this rank's op after next)."""
        self._mailbox_ops += 1
        k = self._mailbox_ops
        buf = k & 1
        base, words, raw = box.base[buf], box.words, box.raw
        me = base[self.rank]
        nbytes = 0 if payload is None else payload.nbytes
        HEAD.pack_into(raw, me + 8, *c.expect, nbytes)
        if payload is not None and nbytes:
            box.payloads(buf, np.dtype(np.uint8), nbytes)[self.rank] = payload.view(np.uint8)
        words[me // 8] = k  # last: a peer that sees the sequence number sees the rest (x86 store order)
        if self._missing(box, buf, k):
            self._wait(c, box, buf, k)
        mine = raw[me + 8 : me + 72]  # the calls; the payload sizes differ in a broadcast
        for p in box.others:
            if raw[base[p] + 8 : base[p] + 72] != mine:
                self.g.reject(c, p, HEAD.unpack_from(raw, base[p] + 8), nbytes)
        return buf

    def _watch_mailbox(self, c: Call) -> None:
        """Run by waits on the sockets in call `c` (see `FramedGroup.watch`): raise if a member posted `c`'s op
        number in the mailbox, i.e. it runs a small op where this rank runs `c` (or, with the same call, its
        AXOND_SHM* settings differ). A member's later op under a later number is a member that ran ahead."""
        box, k = self._mailbox, self._mailbox_ops + 1
        if box is None or c.kind != Kind.COLLECTIVE:
            return
        buf, words = k & 1, box.words
        for at, p in box.peer_seqs[buf]:
            if words[at] != k:
                continue
            head = HEAD.unpack_from(box.raw, box.base[buf][p] + 8)
            if words[at] != k or head[4] != c.seq:  # written before its sequence word; re-read: not overwritten
                continue
            if head[:8] == c.expect:
                raise self.g.error(c, p, f"peer rank {p} runs this call through the shared mailbox but this rank "
                                         f"over the sockets: {SAME_SETTINGS}")
            self.g.reject(c, p, head, None)

    def _missing(self, box: Mailbox, buf: int, k: int) -> list[int]:
        """The peers that have not posted op `k` yet."""
        words = box.words
        return [p for at, p in box.peer_seqs[buf] if words[at] < k]

    def _wait(self, c: Call, box: Mailbox, buf: int, k: int) -> None:
        now = time.perf_counter()
        spin_until, check_at = now + SPIN_SECONDS, now + CHECK_SECONDS
        while self._missing(box, buf, k):
            now = time.perf_counter()
            if now < spin_until and now < check_at:
                os.sched_yield()
                continue
            if self._check_sockets(c, box, buf, k, 0.0 if now < spin_until else SLEEP_SECONDS):
                return
            check_at = now + CHECK_SECONDS

    def _check_sockets(self, c: Call, box: Mailbox, buf: int, k: int, sleep: float) -> bool:
        """Look at (or sleep up to `sleep` on) the group's sockets: raise for an abort, a dead peer or a frame of
        another op from a member that has not posted this op; whether the op may go on."""
        missing = self._missing(box, buf, k)
        if missing and time.monotonic() >= c.deadline:
            raise PeerTimeout(f"no mailbox post from peer {missing[0]}", self.g.peers[missing[0]].rank)
        peers = self.g.peers
        ready, _, _ = select.select([peers[p].sock for p in missing], [], [], sleep) if missing else ([], [], [])
        missing = self._missing(box, buf, k)
        if not missing:
            return True
        for index in missing:
            if peers[index].sock in ready and not self.g.only_early(c, index):
                # it has not posted this op, so this frame is no later op's: its point-to-point frames sent before
                # are set aside; else an abort, EOF or another call raises, and this call means other settings
                raise self.g.error(c, index, f"peer rank {index} runs this call over the sockets but this rank "
                                             f"through the shared mailbox: {SAME_SETTINGS}")
        return False

    def _mailbox_all_reduce(self, c: Call, box: Mailbox, x: np.ndarray, op: ReduceOp) -> None:
        self._reduce_rows(box.payloads(self._post(c, box, x), x.dtype, x.size), x, op)

    def _reduce_rows(self, rows: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """out <- the reduction of every rank's row of `rows`, in rank order."""
        ufunc: Callable[..., np.ndarray] = UFUNCS[op]
        ufunc(rows[0], rows[1], out=out)
        for p in range(2, self.size):
            ufunc(out, rows[p], out=out)
        if op is ReduceOp.AVG:
            finish_average(out, self.size)

    def _mailbox_broadcast(self, c: Call, box: Mailbox, x: np.ndarray, src: int) -> None:
        buf = self._post(c, box, x if self.rank == src else None)
        if self.rank != src:
            x.view(np.uint8)[...] = box.payloads(buf, np.dtype(np.uint8), x.nbytes)[src]

    def _mailbox_all_gather(self, c: Call, box: Mailbox, out: np.ndarray) -> None:
        rows = out.reshape(self.size, -1).view(np.uint8)
        rows[...] = box.payloads(self._post(c, box, rows[self.rank]), np.dtype(np.uint8), rows.shape[1])

    def _mailbox_reduce_scatter(self, c: Call, box: Mailbox, src: np.ndarray, out: np.ndarray,
                                op: ReduceOp) -> None:
        per = out.size
        parts = box.payloads(self._post(c, box, src), src.dtype, src.size)[:, self.rank * per : (self.rank + 1) * per]
        self._reduce_rows(parts, out, op)

    def _mailbox_barrier(self, c: Call, box: Mailbox) -> None:
        self._post(c, box, None)
