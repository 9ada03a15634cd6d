"""Small collectives of ranks on one node through a shared-memory mailbox: one round, no system calls.

Over loopback every small op costs a send and a receive per round, and on a host with more ranks than
cores the kernel's wake-ups between them are most of its latency. The mailbox is a tiny arena (two
buffers of one slot per rank: a sequence word, the op's frame header, up to `policy.mailbox_bytes` of payload).
A small all_reduce, broadcast, all_gather, reduce_scatter or barrier writes this rank's payload and
header into its slot, then its sequence number; it waits until every member's sequence number reaches
the op's, compares their headers with its own (a peer in another op, dtype or size raises on every
rank, naming both calls, as on sockets), and reads what it needs from their slots. Reductions run in
rank order, as everywhere. A broadcast past one slot (groups of three or more) runs one such round per
slot-sized chunk (`mailbox_ops.broadcast_chunks`).

- **Reuse:** consecutive mailbox ops alternate buffers, and a rank writes op m + 2 only after op m + 1
  saw every member's sequence number, i.e. after every member finished reading op m.
- **Waiting** (with the compiled helper, `_fastbox.Box.wait`): poll the members' sequence words for
  MAILBOX_POLL_SECONDS without a system call (only where the host's ranks do not outnumber its cores: a peer
  running on another core posts within microseconds), then yield (`sched_yield`) up to MAILBOX_QUICK_TURNS times
  (a peer on this core runs) where the host's ranks outnumber its cores, then block on the first missing member's
  sequence word (a futex on the shared mapping) until its post wakes this rank. A post wakes anyone only where a
  waiter counted itself in the slot (word 11), so while nobody blocks a post costs no system call. Whether the waits
  yield at all follows what their yields took lately: over MAILBOX_YIELD_LIMIT_SECONDS each (an average), the
  yields ran another process, as a busy loop beside the job, for its time slice, and the waits block at once instead
  (blocking leaves the core to whatever can use it, and the wake-up comes when the peer posts), yielding again
  every 16 to MAILBOX_PROBE_OPS ops to see whether it is cheap again. Without the helper: spinning
  with a yield on each turn, then after MAILBOX_SPIN_SECONDS sleeping on the group's sockets, re-checking every
  MAILBOX_SLEEP_SECONDS.
- **Failures:** after MAILBOX_CHECK_SECONDS of blocking (or spinning), and after every MAILBOX_SLEEP_SECONDS
  block from then on, the wait looks at the group's sockets. There an abort frame, a closed connection (a dead
  peer), or a frame of some other op (a peer that called something else) raises as on sockets, and the deadline
  raises a timeout naming the first member that is missing.
- **A peer waiting on the sockets:** a rank in a larger op that waits for a frame from a member that is in
  a mailbox op instead (or for it to read one) would wait until the timeout, and so would that member. So
  while a group has a mailbox, every wake-up of a wait on its sockets (every RECV_WAKEUP) looks at the
  members' slots: one that posted the mailbox op this rank would run next, under the number of the op
  this rank runs now, called something else, and this rank raises (the member then sees its abort frame).
- **Cores:** with more ranks than cores each rank has a home core (`spread.home`); every 64th compiled op, every
  wake from a block and every long wait move it back there when the kernel moved it (`home`), also while the waits
  block instead of yielding: the kernel wakes a blocked rank beside its waker, and the ranks would end up stacked on
  one core while a busy process had the other to itself.
- **Point-to-point frames** that a member sent before it posted are set aside for their receives (see
  `FramedGroup.only_early`), not taken for another call.
- **The arena's steps** synchronize through the mailbox too: a post without payload (`arena_ops.Sync`; compiled
  where the ops are, as a prepared barrier with the arena op's header).
- **Compiled ops:** where the install built `_fastbox` (C, the same protocol), a prepared op (`mailbox_ops.Prepared`)
  posts, takes the first MAILBOX_QUICK_TURNS turns of the wait, compares the calls and reads or reduces in one C
  call; any longer wait or mismatch comes back here (`settle`). Ranks with and without it share a mailbox.
- **Memory order:** payload, then sequence number: an x86 store order that every x86 core observes in
  that order (TSO). Other architectures keep small ops on the sockets.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp.policy import (
    MAILBOX_CHECK_SECONDS, MAILBOX_HOME_EVERY_OPS, MAILBOX_MOVE_EVERY_OPS, MAILBOX_PROBE_FIRST_OPS,
    MAILBOX_PROBE_OPS, MAILBOX_QUICK_TURNS, MAILBOX_SLEEP_SECONDS,
    MAILBOX_SPIN_SECONDS, MAILBOX_YIELD_LIMIT_SECONDS, mailbox_bytes, mailbox_turns,
)
from axond.distributed.backends.tcp.shm.arena import ShmArena
from axond.distributed.backends.tcp.shm.spread import current_cpu, move_to, release
from axond.distributed.backends.tcp.transport.framing import Call, FramedGroup
from axond.distributed.backends.tcp.transport.peer import PeerTimeout, wait_readable
from axond.distributed.backends.tcp.transport.wire import Kind

try:
    from axond.distributed.backends.tcp.shm import _fastbox
except ImportError:  # pragma: no cover - built without a C compiler: the Python path runs alone
    _fastbox = None  # type: ignore[assignment]

HEAD_WORDS = 16
"""int64 words before the payload: the sequence number, then the op's 9 header fields."""


def arena_bytes(size: int) -> int:
    """The `ShmArena` size whose slots are `slot_bytes(size)`: two buffers of size + 1 slots."""
    return 2 * (size + 1) * slot_bytes(size)


def slot_bytes(size: int) -> int:
    """Bytes of one slot of the mailbox of a group of `size`: the header words, then the largest payload."""
    return HEAD_WORDS * 8 + mailbox_bytes(size)


SAME_SETTINGS = "set AXOND_SHM and AXOND_SHM_MAILBOX alike on every rank"


HEAD = struct.Struct("<9q")
"""Words 1-9 of a slot: the op's header fields (`Call.expect`) and the payload's size."""
SEQ_FIELD = 4
"""The field of HEAD that holds the call's sequence number (`Call.expect`'s fifth)."""
PROGRESS_WORD = 10
"""The slot's word (after HEAD) a compiled broadcast root counts its published bytes in; the Python path leaves it."""
WAITERS_WORD = 11
"""The slot's word whose low half counts the ranks blocked (futex) on its sequence word."""
LAYOUT = {
    "HEAD_OFF": 8, "HEAD_BYTES": HEAD.size, "CALL_BYTES": HEAD.size - 8, "SEQ_OFF": 8 + 8 * SEQ_FIELD,
    "POSTED_OFF": 8 + HEAD.size - 8, "PROGRESS_OFF": 8 * PROGRESS_WORD, "WAITERS_OFF": 8 * WAITERS_WORD,
    "PAYLOAD_OFF": 8 * HEAD_WORDS,
}
"""The slot layout, in bytes from the slot's start (the sequence word): the one definition; the compiled helper's
`#define`s must equal it offset by offset (its `_fastbox.LAYOUT`, checked on import and by
tests/docs_quality/test_mailbox_layout.py)."""
if _fastbox is not None and getattr(_fastbox, "LAYOUT", None) != LAYOUT:
    _fastbox = None  # type: ignore[assignment]  # pragma: no cover - built from another slot layout (stale)


class _Count:
    """The op counter of a mailbox without the compiled helper (`_fastbox.Box` keeps it otherwise)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops = 0

    def close(self) -> None:
        pass


class Mailbox:
    """A group's mapped mailbox, with the offsets and views every op reuses (small ops are mostly overhead), and the
    posts and waits of its ops over group `g` (whose sockets a wait watches). With `native` (and the compiled helper
    built), prepared ops run in C (`_fastbox`, see `mailbox_ops.Prepared`), and every wait polls for `poll` seconds
    (`policy.mailbox_poll_seconds`), yields where the host's ranks are `oversubscribed`, then blocks."""

    def __init__(self, arena: ShmArena, rank: int, size: int, g: FramedGroup, native: bool = True,
                 oversubscribed: bool = False, poll: float = 0.0) -> None:
        slot = slot_bytes(size)
        assert arena.chunk == slot and arena.size == size
        self.g = g
        self.arena = arena
        self.raw = arena.buffer()
        self.mapping = arena.mapping()
        """The same bytes, sliced to compare the members' calls (see `settle`)."""
        self.native = (_fastbox.Box(self.mapping, mailbox_turns(oversubscribed), poll_ns=round(poll * 1e9),
                                    block_ns=round(MAILBOX_CHECK_SECONDS * 1e9),
                                    yield_limit_ns=round(MAILBOX_YIELD_LIMIT_SECONDS * 1e9),
                                    probe_ops=MAILBOX_PROBE_OPS, slot=slot, size=size, rank=rank,
                                    probe_first=MAILBOX_PROBE_FIRST_OPS, home_every=MAILBOX_HOME_EVERY_OPS,
                                    move_every=MAILBOX_MOVE_EVERY_OPS)
                       if native and _fastbox is not None and size <= _fastbox.MAX_SIZE else None)
        """The mapping and op counter as the compiled prepared ops see them (None: the Python path alone)."""
        self.count: _fastbox.Box | _Count = self.native if self.native is not None else _Count()
        """`count.ops`: mailbox ops run so far in this group, the next one's sequence number minus one."""
        self.words = self.raw.cast("q")
        self.rank, self.size = rank, size
        self.slot = slot
        self.payload_bytes = slot - HEAD_WORDS * 8
        """The most payload bytes a rank posts in one op (a broadcast past it runs in chunks, `mailbox_ops`)."""
        self.base = [[(b * (size + 1) + p) * slot for p in range(size)] for b in (0, 1)]
        """Byte offset of each rank's slot in each buffer."""
        self.others = [p for p in range(size) if p != rank]
        self.peer_seqs = [[(self.base[b][p] // 8, p) for p in self.others] for b in (0, 1)]
        """(index in `words` of the sequence word, rank) of each peer's slot in each buffer."""
        self.peer_slots = [tuple(self.base[b][p] for p in self.others) for b in (0, 1)]
        """Byte offset of each peer's slot in each buffer (what `_fastbox.Box.wait` watches)."""
        self._payloads: dict[tuple[int, np.dtype, int], np.ndarray] = {}
        self._home: int | None = None
        self._home_thread: weakref.ref[threading.Thread] | None = None
        """The thread `spread` gave the home (released on closing)."""

    @property
    def home(self) -> int | None:
        """This rank's core where the group's ranks outnumber their cores (`spread.home`), else None. The kernel wakes
        a sleeper wherever it likes, and its balancer moves spinning ranks off a core another process used for a
        while: a long wait (`_wait`) that finds this rank elsewhere moves it back, and so does every 64th compiled op
        (`_fastbox.Box.home`)."""
        return self._home

    @home.setter
    def home(self, core: int | None) -> None:
        """Set by the thread `spread` ran on, which holds the home until this mailbox closes."""
        self._home = core
        self._home_thread = weakref.ref(threading.current_thread()) if core is not None else None
        if self.native is not None:
            self.native.home = -1 if core is None else core

    @property
    def ops(self) -> int:
        """Mailbox ops run so far in this group."""
        return self.count.ops

    def payloads(self, buf: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Every rank's payload in buffer `buf` as a (size, count) array of `dtype` (cached)."""
        key = (buf, dtype, count)
        view = self._payloads.get(key)
        if view is None:
            if len(self._payloads) >= 64:
                self._payloads.clear()
            slots = self.arena.slots(buf, np.dtype(np.uint8), self.slot)
            view = self._payloads[key] = slots[:, HEAD_WORDS * 8 : HEAD_WORDS * 8 + count * dtype.itemsize].view(dtype)
        return view

    def post(self, c: Call, payload: np.ndarray | None) -> int:
        """Write `payload` (flat, contiguous, or None) to this rank's slot and wait for every member's slot of
        this op; returns the buffer the op used (its payloads stay valid until this rank's op after next)."""
        count = self.count
        count.ops += 1
        k = count.ops
        buf = k & 1
        me = self.base[buf][self.rank]
        nbytes = 0 if payload is None else payload.nbytes
        HEAD.pack_into(self.raw, me + 8, *c.expect, nbytes)
        if payload is not None and nbytes:
            self.payloads(buf, np.dtype(np.uint8), nbytes)[self.rank] = payload.view(np.uint8)
        self.publish(me, k)
        self.settle(buf, k, nbytes, lambda _: c, 0)
        return buf

    def publish(self, me: int, k: int) -> None:
        """Op `k`'s sequence word into this rank's slot at byte offset `me`, last: a peer that sees it sees the rest
        (x86 store order). The compiled helper also wakes the peers blocked on it."""
        if self.native is not None:
            self.native.publish(me, k)
        else:
            self.words[me // 8] = k

    def settle(self, buf: int, k: int, nbytes: int, make_call: Callable[[int], Call], seq: int) -> None:
        """Wait until every member posted op `k` (in buffer `buf`), then compare their calls with this rank's.

        `make_call(seq)` gives this rank's `Call`; a prepared op (`mailbox_ops.SmallAllReduce`) makes it only if the
        wait is longer than a few turns or a member posted another call."""
        native = self.native
        if native is not None:
            if not native.wait(self.peer_slots[buf], k, MAILBOX_CHECK_SECONDS):
                self._wait(make_call(seq), buf, k)
        elif not self._quick(buf, k):
            self._wait(make_call(seq), buf, k)
        base, mapping = self.base[buf], self.mapping
        me = base[self.rank]
        mine = mapping[me + 8 : me + 72]  # the calls; the payload sizes differ in a broadcast
        for p in self.others:
            if mapping[base[p] + 8 : base[p] + 72] != mine:
                self.g.reject(make_call(seq), p, HEAD.unpack_from(self.raw, base[p] + 8), nbytes)

    def _quick(self, buf: int, k: int) -> bool:
        """Whether every member posted op `k` within MAILBOX_QUICK_TURNS turns."""
        words, turns = self.words, MAILBOX_QUICK_TURNS
        for at, _ in self.peer_seqs[buf]:
            while words[at] < k:
                if not turns:
                    return False
                os.sched_yield()
                turns -= 1
        return True

    def watch(self, c: Call) -> None:
        """Run by waits on the sockets in call `c` (see `FramedGroup.watch`): raise if a member posted `c`'s op
        number in the mailbox, i.e. it runs a small op where this rank runs `c` (or, with the same call, its
        AXOND_SHM* settings differ). A member's later op under a later number is a member that ran ahead."""
        k = self.ops + 1
        if c.kind != Kind.COLLECTIVE:
            return
        buf, words = k & 1, self.words
        for at, p in self.peer_seqs[buf]:
            if words[at] != k:
                continue
            head = HEAD.unpack_from(self.raw, self.base[buf][p] + 8)
            if words[at] != k or head[4] != c.seq:  # written before its sequence word; re-read: not overwritten
                continue
            if head[:8] == c.expect:
                raise self.g.error(c, p, f"peer rank {p} runs this call through the shared mailbox but this rank "
                                         f"over the sockets: {SAME_SETTINGS}")
            self.g.reject(c, p, head, None)

    def _missing(self, buf: int, k: int) -> list[int]:
        """The peers that have not posted op `k` yet."""
        words = self.words
        return [p for at, p in self.peer_seqs[buf] if words[at] < k]

    def _wait(self, c: Call, buf: int, k: int) -> None:
        native = self.native
        if native is not None:  # it waited MAILBOX_CHECK_SECONDS already (`settle`)
            slots = self.peer_slots[buf]
            while not self._check_sockets(c, buf, k, 0.0) and not native.wait(slots, k, MAILBOX_SLEEP_SECONDS):
                pass
            if self.home is not None and current_cpu() != self.home:
                move_to(self.home)  # the kernel moved it (balancing, or waking it): back to its core
            return
        now = time.perf_counter()
        spin_until, check_at = now + MAILBOX_SPIN_SECONDS, now + MAILBOX_CHECK_SECONDS
        while self._missing(buf, k):
            now = time.perf_counter()
            if now < spin_until and now < check_at:
                os.sched_yield()
                continue
            if self._check_sockets(c, buf, k, 0.0 if now < spin_until else MAILBOX_SLEEP_SECONDS):
                break
            check_at = now + MAILBOX_CHECK_SECONDS
        if self.home is not None and current_cpu() != self.home:
            move_to(self.home)  # the kernel moved it (balancing, or waking it from a sleep): back to its core

    def _check_sockets(self, c: Call, buf: int, k: int, sleep: float) -> bool:
        """Look at (or sleep up to `sleep` on) the group's sockets: raise for an abort, a dead peer or a frame of
        another op from a member that has not posted this op; whether the op may go on."""
        missing = self._missing(buf, k)
        if missing and time.monotonic() >= c.deadline:
            raise PeerTimeout(f"no mailbox post from peer {missing[0]}", self.g.peers[missing[0]].rank)
        peers = self.g.peers
        ready = wait_readable([peers[p] for p in missing], sleep)
        missing = self._missing(buf, k)
        if not missing:
            return True
        for index in missing:
            if peers[index] in ready and not self.g.only_early(c, index):
                # it has not posted this op, so this frame is no later op's: its point-to-point frames sent before
                # are set aside; else an abort, EOF or another call raises, and this call means other settings
                raise self.g.error(c, index, f"peer rank {index} runs this call over the sockets but this rank "
                                             f"through the shared mailbox: {SAME_SETTINGS}")
        return False

    def close(self) -> None:
        if self._home_thread is not None:
            release(self._home_thread())
            self._home_thread = None
        self.count.close()  # the compiled ops' hold on the mapping, before the arena unmaps it
        self._payloads.clear()
        self.words.release()
        self.raw.release()
        self.arena.close()


