"""Buddy copies kept by the buddy's worker daemon: the rank's side.

Under `axond worker --live-recovery` each worker runs a relay (`axond.worker.buddy_relay`): a TCP listener on its
data-plane address, in the rank's environment as `AXOND_COPY_RELAY`, that keeps the copies other nodes' ranks send it
in the node's held memory (one memfd, inherited by every local rank as `AXOND_HELD_MEMORY_FD`). A rank's buddy copy
goes there instead of to the buddy rank's process, and it is the rank's own worker that sends it
(`axond.worker.copy_forward`), from the copy the rank has just made in that worker's memory (`axond.train.daemon_copy`):
the rank writes a request into that memory's header and one byte to a pipe (`AXOND_COPY_FORWARD_FD`), and reads the
worker's answer there (the tag the buddy's worker kept) before its next gradient gather. The rank neither reads nor
sends the copy; the copy outlives the buddy rank too. After a re-formation every rank of the node offers the copies its
node holds (`held_slots`), advanced by the gradients it kept where it is their buddy (`axond.train.buddy`).

The relay authenticates each connection with the job's secret (HMAC over a nonce it draws, `axond.copy_layout`);
nothing else is read from a connection that fails it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

from axond.copy_layout import DIRECTORY_WORDS, ENTRIES, ENTRY_WORDS, HELD_MAGIC, OFFSET, SLOT_BYTES, region_bytes
from axond.parallel.zero.virtual import VirtualZero
from axond.train.buddy import Slot
from axond.train.daemon_copy import DaemonCopy, Forwarding, region_slots

ADDRESS_WORDS = 8
"""int64 words a relay's "host:port" is gathered in (64 bytes, zero-padded)."""

def address_words(address: str | None) -> np.ndarray:
    """`address` ("host:port", or None: no relay) as ADDRESS_WORDS int64 words, for an all_gather."""
    raw = (address or "").encode()
    if len(raw) > ADDRESS_WORDS * 8:
        raise ValueError(f"AXOND_COPY_RELAY={address!r} is longer than {ADDRESS_WORDS * 8} bytes")
    return np.frombuffer(raw.ljust(ADDRESS_WORDS * 8, b"\0"), np.int64).copy()


def words_address(words: np.ndarray) -> str | None:
    raw = np.ascontiguousarray(words, np.int64).tobytes().rstrip(b"\0")
    return raw.decode() if raw else None


def held_slots(fd: int, zero: VirtualZero, lineage: int) -> list[tuple[int, Slot, range]]:
    """Every complete copy of this job's layout and `lineage` the node holds for other nodes' ranks: (tag, slot,
    shards); the slots read the node's held memory in place (mapped read-only, kept while they are)."""
    size = os.fstat(fd).st_size
    if size < DIRECTORY_WORDS * 8:
        return []
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    directory = np.frombuffer(mapping, np.int64, DIRECTORY_WORDS)
    if int(directory[0]) != HELD_MAGIC:
        return []
    found = []
    for i in range(min(int(directory[1]), ENTRIES)):
        entry = directory[2 + i * ENTRY_WORDS : 2 + (i + 1) * ENTRY_WORDS]
        base, slot_bytes = int(entry[OFFSET]), int(entry[SLOT_BYTES])
        if base <= 0 or slot_bytes <= 0 or base + region_bytes(slot_bytes) > size:
            continue
        found += region_slots(mapping, base, slot_bytes, zero, lineage)
    return found


class RelayedCopies:
    """`axond.train.buddy.Relayed` over this rank's `DaemonCopy`, its worker's pipe and its node's held memory."""

    def __init__(self, daemon: DaemonCopy, held_fd: int, forward_fd: int, lineage: Callable[[], int]) -> None:
        self.daemon, self.held_fd, self._lineage = daemon, held_fd, lineage
        daemon.forward_fd = forward_fd

    def target(self, address: str | None) -> None:
        """Have the copies sent to the relay at `address` (the buddy's worker); None: nowhere. A send still in flight
        to the old buddy is not waited for: the worker gives it up at the next request."""
        self.daemon.forward_to = address

    def forward(self, tag: int) -> Forwarding | None:
        return self.daemon.forward(tag)

    def held(self) -> list[tuple[int, Slot, range]]:
        try:
            return held_slots(self.held_fd, self.daemon.zero, self._lineage())
        except (OSError, ValueError):  # no held memory to read: nothing offered from it
            return []
