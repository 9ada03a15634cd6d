"""Buddy copies kept by the buddy's worker daemon: the rank's side.

Under `axond worker --live-recovery` each worker runs a relay (`axond.worker.buddy_relay`): a TCP listener on its
data-plane address, in the rank's environment as `AXOND_COPY_RELAY`, that keeps the copies other nodes' ranks send it in
the node's held memory (one memfd, inherited by every local rank as `AXOND_HELD_MEMORY_FD`). A rank sends its buddy copy
there instead of to the buddy rank's process: straight from the copy in its own worker's memory
(`axond.train.daemon_copy`), no copy of its own made for it, on the daemon copy's background thread; the buddy's worker
answers the tag it kept. The copy then outlives the buddy rank too, and nothing of it runs on either rank's training
thread. After a re-formation every rank of the node offers the copies its node holds (`held_slots`), advanced by the
gradients it kept where it is their buddy (`axond.train.buddy`).

The relay authenticates each connection with the job's secret (HMAC over a nonce the worker draws,
`axond.copy_layout`); nothing else is read from a connection that fails it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from axond.copy_layout import (ACK, AUTH_CONTEXT, COUNT, DIRECTORY_WORDS, ENTRIES, ENTRY_WORDS, FIRST, HELD_MAGIC,
                               LINEAGE, MAX_PAYLOAD, NONCE_BYTES, OFFSET, RELAY_MAGIC, REQUEST, SCALARS, SLOT_BYTES,
                               TAG, WIDTH, region_bytes)
from axond.parallel.zero.virtual import VirtualZero
from axond.train.buddy import Slot
from axond.train.daemon_copy import DaemonCopy, region_slots

ADDRESS_WORDS = 8
"""int64 words a relay's "host:port" is gathered in (64 bytes, zero-padded)."""

REFUSALS = {-1: "its fields do not fit together", -2: f"it is over the relay's bound of {MAX_PAYLOAD} bytes",
            -3: "the worker could not size its memory for it (is /dev/shm full?)"}


def address_words(address: str | None) -> np.ndarray:
    """`address` ("host:port", or None: no relay) as ADDRESS_WORDS int64 words, for an all_gather."""
    raw = (address or "").encode()
    if len(raw) > ADDRESS_WORDS * 8:
        raise ValueError(f"AXOND_COPY_RELAY={address!r} is longer than {ADDRESS_WORDS * 8} bytes")
    return np.frombuffer(raw.ljust(ADDRESS_WORDS * 8, b"\0"), np.int64).copy()


def words_address(words: np.ndarray) -> str | None:
    raw = np.ascontiguousarray(words, np.int64).tobytes().rstrip(b"\0")
    return raw.decode() if raw else None


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host in brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"AXOND_COPY_RELAY={address!r} is not host:port (it is set by `axond worker`)")
    return host.strip("[]"), int(port)


class RelayClient:
    """This rank's connection to its buddy's worker (made at the first send, made again after a failure)."""

    def __init__(self, address: str, secret: bytes, node: int, local_rank: int, timeout: float) -> None:
        self.address, self.secret, self.node, self.local_rank = address, secret, node, local_rank
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self.sent = 0
        """Copies the buddy's worker kept."""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(split_address(self.address), timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = _recv_exactly(sock, NONCE_BYTES)
            sock.sendall(hmac.new(self.secret, AUTH_CONTEXT + nonce, hashlib.sha256).digest())
            if _recv_exactly(sock, 1) != b"\x01":
                raise ConnectionError(f"the copy relay at {self.address} refused this job's secret")
        except BaseException:
            sock.close()
            raise
        return sock

    def send(self, payload: memoryview, fingerprint: int, words: list[int]) -> int:
        """Send `payload` (a slot of a region, its header `words`); returns the tag the buddy's worker kept. Raises
        `OSError` (the connection is then made again at the next send) or `ValueError`. A connection kept from an
        earlier send that turns out closed is made again once."""
        reused = self._sock is not None
        try:
            return self._send(payload, fingerprint, words)
        except (ConnectionError, BrokenPipeError):
            if not reused:
                raise
        return self._send(payload, fingerprint, words)

    def _send(self, payload: memoryview, fingerprint: int, words: list[int]) -> int:
        if self._sock is None:
            self._sock = self._connect()
        sock = self._sock
        try:
            sock.sendall(REQUEST.pack(RELAY_MAGIC, self.node, self.local_rank, fingerprint, words[TAG], words[FIRST],
                                      words[COUNT], words[LINEAGE], words[WIDTH], words[SCALARS], payload.nbytes))
            sock.sendall(payload)  # measured: half sendfile's CPU over loopback, the same over a veth pair
            (kept,) = ACK.unpack(_recv_exactly(sock, ACK.size))
        except BaseException:
            self.close()
            raise
        if kept < 0:
            self.close()  # the relay closes a connection it refused a copy on
            raise ValueError(f"the copy relay at {self.address} kept no copy: {REFUSALS.get(kept, kept)}")
        self.sent += 1
        return kept

    def interrupt(self) -> None:
        """End a send blocked on the connection (from another thread)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the copy relay closed the connection")
        got += k
    return bytes(buf)


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
    """`axond.train.buddy.Relayed` over this rank's `DaemonCopy` and its node's held memory."""

    def __init__(self, daemon: DaemonCopy, held_fd: int, lineage: Callable[[], int]) -> None:
        self.daemon, self.held_fd, self._lineage = daemon, held_fd, lineage

    def target(self, address: str | None, secret: bytes, node: int, local_rank: int, timeout: float) -> None:
        """Send to the relay at `address` (the buddy's worker), proving `secret`; None: nowhere."""
        old = self.daemon.relay
        if old is not None and (old.address, old.secret, old.node, old.local_rank) == (address, secret, node,
                                                                                     local_rank):
            old.timeout = timeout
            return
        self.daemon.settle_forward_quietly()
        if old is not None:
            old.close()
        self.daemon.relay = RelayClient(address, secret, node, local_rank, timeout) if address else None

    def forward(self, tag: int) -> Future[int] | None:
        return self.daemon.forward(tag)

    def interrupt(self) -> None:
        relay = self.daemon.relay
        if relay is not None:
            relay.interrupt()

    def held(self) -> list[tuple[int, Slot, range]]:
        try:
            return held_slots(self.held_fd, self.daemon.zero, self._lineage())
        except (OSError, ValueError):  # no held memory to read: nothing offered from it
            return []
