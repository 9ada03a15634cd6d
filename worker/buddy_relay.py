"""The worker daemon's relay: other nodes' workers send it their ranks' buddy copies, and it keeps them in the node's
held memory, where this node's ranks read them after a re-formation (`axond.train.relay`).

One relay per live job on this node, for the job's life: a TCP listener on the data-plane address (in each rank's
environment as `AXOND_COPY_RELAY`), one thread per connection. A connection proves the job's secret first (HMAC over a
nonce drawn here; the secrets of the job's last `SECRETS` generations are accepted, so that a copy sent just before a
re-formation is still kept): until then it holds a slot among `MAX_UNPROVEN`, and nothing it sends is read beyond its
proof. A proven connection sends copies, each a fixed request, a slot's payload and the sender's verdict on it
(`axond.copy_layout`), received straight into the held memory (one memfd, inherited by every local rank as
`AXOND_HELD_MEMORY_FD`): one region per source rank (its node key and local rank), double-buffered like the rank's own
copy in its worker's memory, its slot's state word cleared before the payload and set after it; a copy cut half-way is
never read. Each copy is answered with the tag kept, or a refusal (a torn copy's: the connection goes on; any other: it
is closed). Other nodes' ranks' copies are sent by their workers (`axond.worker.copy_forward`). The memory goes when the
worker closes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from axond.store.tcp_server import recv_exact
from axond.copy_layout import (ACK, AUTH_CONTEXT, DIRECTORY_WORDS, ENTRIES, ENTRY_WORDS, HEADER_BYTES, HELD_MAGIC,
                               KEY_LOCAL, KEY_NODE, MAGIC, MAX_PAYLOAD, NONCE_BYTES, OFFSET, REFUSED_MALFORMED,
                               REFUSED_NO_MEMORY, REFUSED_TOO_LARGE, REFUSED_TORN, RELAY_MAGIC, REQUEST, SLOT_BYTES,
                               SLOT_WORDS,
                               STATE, TAG, VALID, VERDICT, aligned, region_bytes, slot_offset, word_index)

HELD_MEMORY_ENV = "AXOND_HELD_MEMORY_FD"
RELAY_ENV = "AXOND_COPY_RELAY"
SECRETS = 4
"""Generations whose secret a connection may prove."""
MAX_UNPROVEN = 16
"""Connections that have not proven the secret yet; more are closed at once."""
MAX_CONNECTIONS = 512
"""Proven connections (one per rank sending copies to this node)."""
PROOF_S = 5.0
"""Seconds a connection has to prove the secret."""
DATA_S = 60.0
"""Seconds any one read of a copy's request or payload may wait."""
IDLE_S = 3600.0
"""Seconds a proven connection may stay idle between copies (a source on a host that vanished without a word)."""
_WORD = struct.Struct("<q")


class HeldMemory:
    """The node's memfd of other nodes' copies: a directory page, then one region per source."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("axond-held")
        self._lock = threading.Lock()
        os.ftruncate(self.fd, HEADER_BYTES)
        self._directory = mmap.mmap(self.fd, HEADER_BYTES)
        self._set(0, HELD_MAGIC)
        self._end = HEADER_BYTES
        self._regions: dict[tuple[int, int], tuple[int, int, int, mmap.mmap]] = {}
        """(node key, local rank) -> (entry, offset, slot bytes, the region's mapping)."""
        self._free: list[tuple[int, int]] = []
        """Regions no entry points at any more: (offset, slot bytes), reused before the file grows."""
        self._writes = 0

    def _set(self, word: int, value: int) -> None:
        _WORD.pack_into(self._directory, word * 8, value)

    def region(self, key: tuple[int, int], fingerprint: int, need: int) -> tuple[mmap.mmap, int]:
        """The mapping of `key`'s region (its slot bytes): the one it has when its slots fit `need` bytes of the same
        fingerprint, else a new one (both slots empty). Raises `OSError` when the memory cannot be sized."""
        with self._lock:
            self._writes += 1
            held = self._regions.get(key)
            if held is not None:
                entry, offset, slot_bytes, mapping = held
                if slot_bytes >= need and _word(mapping, 1) == fingerprint:
                    self._set(2 + ENTRIES * ENTRY_WORDS + entry, self._writes)
                    return mapping, slot_bytes
                self._release(key)
            entry = self._entry_for(key)
            slot_bytes = aligned(need)
            reused = next(((o, s) for o, s in self._free if s >= slot_bytes), None)
            if reused is not None:
                self._free.remove(reused)
                offset, slot_bytes = reused
            else:
                offset, size = self._end, self._end + region_bytes(slot_bytes)
                os.ftruncate(self.fd, size)
                try:
                    os.posix_fallocate(self.fd, offset, size - offset)  # a full /dev/shm fails here, not mid-copy
                except OSError:
                    os.ftruncate(self.fd, self._end)
                    raise
                self._end = size
            mapping = mmap.mmap(self.fd, region_bytes(slot_bytes), offset=offset)
            mapping[:HEADER_BYTES] = bytes(HEADER_BYTES)
            _put(mapping, 1, fingerprint)
            _put(mapping, 0, MAGIC)
            self._regions[key] = (entry, offset, slot_bytes, mapping)
            base = 2 + entry * ENTRY_WORDS
            self._set(base + KEY_NODE, key[0])
            self._set(base + KEY_LOCAL, key[1])
            self._set(base + SLOT_BYTES, slot_bytes)
            self._set(base + OFFSET, offset)  # last: a reader never follows an entry half-written to a region
            self._set(2 + ENTRIES * ENTRY_WORDS + entry, self._writes)
            return mapping, slot_bytes

    def _entry_for(self, key: tuple[int, int]) -> int:
        used = {e for e, _, _, _ in self._regions.values()}
        count = _WORD.unpack_from(self._directory, 8)[0]
        if count < ENTRIES:
            self._set(1, count + 1)
            return int(count)
        free = [e for e in range(ENTRIES) if e not in used]
        if free:
            return free[0]
        stamps = [_WORD.unpack_from(self._directory, (2 + ENTRIES * ENTRY_WORDS + e) * 8)[0] for e in range(ENTRIES)]
        oldest = min(range(ENTRIES), key=lambda e: stamps[e])
        victim = next(k for k, (e, _, _, _) in self._regions.items() if e == oldest)
        self._release(victim)
        return oldest

    def _release(self, key: tuple[int, int]) -> None:
        entry, offset, slot_bytes, mapping = self._regions.pop(key)
        self._set(2 + entry * ENTRY_WORDS + OFFSET, 0)
        with contextlib.suppress(BufferError):
            mapping.close()
        self._free.append((offset, slot_bytes))

    def close(self) -> None:
        with self._lock:
            for _, _, _, mapping in self._regions.values():
                with contextlib.suppress(BufferError):
                    mapping.close()
            self._regions = {}
            with contextlib.suppress(BufferError):
                self._directory.close()
            with contextlib.suppress(OSError):
                os.close(self.fd)


def _word(mapping: mmap.mmap, index: int) -> int:
    return int(_WORD.unpack_from(mapping, index * 8)[0])


def _put(mapping: mmap.mmap, index: int, value: int) -> None:
    _WORD.pack_into(mapping, index * 8, value)


class BuddyRelay:
    """This node's relay for one live job (see the module docstring)."""

    def __init__(self, host: str, notice: Callable[[str], None] = lambda line: None) -> None:
        self.held = HeldMemory()
        self._notice = notice
        self._secrets: deque[bytes] = deque(maxlen=SECRETS)
        self._lock = threading.Lock()
        self._unproven = threading.BoundedSemaphore(MAX_UNPROVEN)
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.settimeout(0.5)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.kept = 0
        """Copies kept since the relay started."""
        self.receive_cpu_s = 0.0
        """CPU seconds its connections' threads spent receiving copies (this process's share of the buddy copies)."""
        self._thread = threading.Thread(target=self._serve, name="axond-buddy-relay", daemon=True)
        self._thread.start()

    def admit(self, secret: bytes) -> None:
        """Accept connections proving `secret` (a generation's; the last SECRETS generations' are accepted)."""
        with self._lock:
            if secret and secret not in self._secrets:
                self._secrets.append(secret)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._unproven.acquire(blocking=False):
                conn.close()
                continue
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    self._unproven.release()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._connection, args=(conn,), name="axond-buddy-relay-conn", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            try:
                proven = self._prove(conn)
            finally:
                self._unproven.release()
            while proven and not self._closed.is_set() and self._copy(conn):
                pass
        except (OSError, ValueError, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _prove(self, conn: socket.socket) -> bool:
        conn.settimeout(PROOF_S)
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(nonce)
        mac = recv_exact(conn, hashlib.sha256().digest_size)
        with self._lock:
            known = list(self._secrets)
        if not any(hmac.compare_digest(mac, hmac.new(s, AUTH_CONTEXT + nonce, hashlib.sha256).digest())
                   for s in known):
            conn.sendall(b"\x00")
            return False
        conn.sendall(b"\x01")
        return True

    def _copy(self, conn: socket.socket) -> bool:
        """Receive one copy into the held memory and answer; False when the connection is done."""
        conn.settimeout(IDLE_S)
        first = conn.recv(1, socket.MSG_PEEK)
        if not first:
            return False
        conn.settimeout(DATA_S)
        (magic, node, local, fingerprint, tag, first_shard, count, lineage, width, nscalars,
         payload) = REQUEST.unpack(recv_exact(conn, REQUEST.size))
        refused = _refusal(magic, tag, first_shard, count, width, nscalars, payload)
        if refused:
            conn.sendall(ACK.pack(refused))
            return False
        try:
            mapping, slot_bytes = self.held.region((node, local), fingerprint, payload)
        except OSError as e:
            self._notice(f"cannot keep a buddy copy of {payload} bytes from rank {local} of node {node:x}: {e}")
            conn.sendall(ACK.pack(REFUSED_NO_MEMORY))
            return False
        began = time.thread_time()
        index = _slot_to_write(mapping)
        _put(mapping, word_index(index, STATE), 0)
        start = slot_offset(slot_bytes, index)
        view = memoryview(mapping)[start : start + payload]
        try:
            got = 0
            while got < payload:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return False  # cut half-way: the slot stays marked empty
                got += n
        finally:
            view.release()
        (verdict,) = VERDICT.unpack(recv_exact(conn, VERDICT.size))
        if verdict != tag:  # the sender's slot was written again while it was read: never kept
            conn.sendall(ACK.pack(REFUSED_TORN))
            return True
        for word, value in zip(range(1, 7), (tag, first_shard, count, lineage, width, nscalars)):
            _put(mapping, word_index(index, word), value)
        _put(mapping, word_index(index, STATE), VALID)
        with self._lock:
            self.kept += 1
            self.receive_cpu_s += time.thread_time() - began
        conn.sendall(ACK.pack(tag))
        return True

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2.0)
        self.held.close()


def _refusal(magic: int, tag: int, first: int, count: int, width: int, nscalars: int, payload: int) -> int:
    """0 when a request's fields fit together, else the refusal to answer."""
    if magic != RELAY_MAGIC or tag < 0 or first < 0 or count <= 0 or width <= 0 or nscalars <= 0 or payload <= 0:
        return REFUSED_MALFORMED
    if payload > MAX_PAYLOAD:
        return REFUSED_TOO_LARGE
    if count * nscalars * 8 >= payload or count > MAX_PAYLOAD // 8:
        return REFUSED_MALFORMED
    return 0


def _slot_to_write(mapping: mmap.mmap) -> int:
    """The slot not holding the newest complete copy."""
    done = [i for i in range(2) if _word(mapping, word_index(i, STATE)) == VALID]
    if not done:
        return 0
    newest = max(done, key=lambda i: _word(mapping, word_index(i, TAG)))
    return 1 - newest


assert SLOT_WORDS >= 7 and DIRECTORY_WORDS * 8 <= HEADER_BYTES
