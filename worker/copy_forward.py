"""The worker daemon sends its ranks' buddy copies to the buddy's worker: the rank copies its block into the memory
this worker keeps for it (`axond.train.daemon_copy`) and asks for the send through that memory's header and a pipe
(`axond.copy_layout`); this worker's thread for that local rank reads the slot from its own mapping and sends it to
the buddy node's relay (`axond.worker.buddy_relay`). The rank's process neither reads nor sends the copy: on a node
with a spare core the buddy copy costs its training nothing but the daemon copy.

A slot the rank writes again while it is being sent (the rank stopped waiting for the send) is detected after the
send (its state and tag read again) and the relay is told to drop it (`VERDICT`): a torn copy is never kept.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from axond.copy_layout import (ACK, ADDRESS_AT, ADDRESS_BYTES, AUTH_CONTEXT, COUNT, FIRST, FORWARD_BASE,
                               FORWARD_BYTES, FORWARD_DONE, FORWARD_RESULT, FORWARD_SEQ, FORWARD_SLOT, FORWARD_TAG,
                               HEADER_BYTES, LINEAGE, MAGIC, MAX_PAYLOAD, NONCE_BYTES, RELAY_MAGIC, REQUEST, SCALARS,
                               SLOT_WORDS, STATE, TAG, UNSENT, VALID, VERDICT, WIDTH, slot_offset, word_index)

FORWARD_ENV = "AXOND_COPY_FORWARD_FD"
SEND_TIMEOUT_S = 30.0
"""Seconds one wait of a send on the buddy's relay may last (a new request from the rank ends it at once)."""
_WORD = struct.Struct("<q")


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host in brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"relay address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class Superseded(Exception):
    """The rank asked for another send while this one waited on the network: this one is given up."""


class RelayClient:
    """One connection to a buddy's relay (made at the first send, made again after a failure). Every wait on the
    network also watches `watch_fd` (the rank's pipe): a new request ends it (`Superseded`), so that a send stalled on
    a lost buddy's link never holds up the sends of the next generation."""

    def __init__(self, address: str, secret: bytes, node: int, local_rank: int, timeout: float,
                 watch_fd: int | None = None) -> None:
        self.address, self.secret, self.node, self.local_rank = address, secret, node, local_rank
        self.timeout, self.watch_fd = timeout, watch_fd
        self._sock: socket.socket | None = None
        self.sent = 0
        """Copies the buddy's worker kept."""

    def _wait(self, sock: socket.socket, write: bool) -> None:
        watch = [self.watch_fd] if self.watch_fd is not None else []
        readable, writable, _ = select.select(watch + ([] if write else [sock]), [sock] if write else [], [],
                                              self.timeout)
        if self.watch_fd is not None and self.watch_fd in readable:
            raise Superseded()
        if not readable and not writable:
            raise TimeoutError(f"the copy relay at {self.address} did not answer within {self.timeout} s")

    def _sendall(self, sock: socket.socket, data: bytes | memoryview) -> None:
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            self._wait(sock, write=True)
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                continue

    def _recv_exactly(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._wait(sock, write=False)
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:
                continue
            if k == 0:
                raise ConnectionError(f"the copy relay at {self.address} closed the connection")
            got += k
        return bytes(buf)

    def _connect(self) -> socket.socket:
        host, port = split_address(self.address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sock.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
                raise ConnectionRefusedError(f"cannot reach the copy relay at {self.address}")
            self._wait(sock, write=True)
            failed = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if failed:
                raise ConnectionError(f"cannot reach the copy relay at {self.address}: {os.strerror(failed)}")
            nonce = self._recv_exactly(sock, NONCE_BYTES)
            self._sendall(sock, hmac.new(self.secret, AUTH_CONTEXT + nonce, hashlib.sha256).digest())
            if self._recv_exactly(sock, 1) != b"\x01":
                raise ConnectionError(f"the copy relay at {self.address} refused this job's secret")
        except BaseException:
            sock.close()
            raise
        return sock

    def send(self, payload: memoryview, fingerprint: int, words: list[int], intact: Callable[[], bool]) -> int:
        """Send `payload` (a slot, its header `words`), then whether `intact()` still holds; returns the tag the relay
        kept, or its negative answer. Raises `OSError` (the connection is made again at the next send) or
        `Superseded`. A connection kept from an earlier send that turns out closed is made again once."""
        reused = self._sock is not None
        try:
            return self._send(payload, fingerprint, words, intact)
        except (ConnectionError, BrokenPipeError):
            if not reused:
                raise
        return self._send(payload, fingerprint, words, intact)

    def _send(self, payload: memoryview, fingerprint: int, words: list[int], intact: Callable[[], bool]) -> int:
        if self._sock is None:
            self._sock = self._connect()
        sock = self._sock
        try:
            self._sendall(sock, REQUEST.pack(RELAY_MAGIC, self.node, self.local_rank, fingerprint, words[TAG],
                                             words[FIRST], words[COUNT], words[LINEAGE], words[WIDTH], words[SCALARS],
                                             payload.nbytes))
            self._sendall(sock, payload)  # measured: half sendfile's CPU over loopback, the same over a veth pair
            self._sendall(sock, VERDICT.pack(words[TAG] if intact() else -1))
            (kept,) = ACK.unpack(self._recv_exactly(sock, ACK.size))
        except BaseException:
            self.close()
            raise
        if kept >= 0:
            self.sent += 1
        return int(kept)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


class Forwarder:
    """The sends of one local rank's copies (a thread, woken by the rank's byte on its pipe)."""

    def __init__(self, memory_fd: int, local_rank: int, node: int, secret: Callable[[], bytes],
                 notice: Callable[[str], None] = lambda line: None) -> None:
        self.memory_fd, self.local_rank, self.node = memory_fd, local_rank, node
        self._secret, self._notice = secret, notice
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, False)  # the launcher passes it to the rank (pass_fds)
        self._map: mmap.mmap | None = None
        self._clients: dict[str, RelayClient] = {}
        self._closed = threading.Event()
        self._done = -1
        self.sent = 0
        self.send_cpu_s = 0.0
        """CPU seconds this thread spent sending copies (the worker's share of the buddy copies)."""
        self._thread = threading.Thread(target=self._run, name=f"axond-copy-forward-{local_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self.read_fd], [], [], 0.5)
                if not ready:
                    continue
                if not os.read(self.read_fd, 4096):
                    return
            except OSError:
                return
            with contextlib.suppress(Exception):  # a bad request is answered below; nothing ends this thread
                self._serve()

    def _mapping(self) -> mmap.mmap | None:
        size = os.fstat(self.memory_fd).st_size
        if size < HEADER_BYTES:
            return None
        if self._map is None or len(self._map) != size:
            old, self._map = self._map, None
            if old is not None:
                with contextlib.suppress(BufferError):
                    old.close()
            self._map = mmap.mmap(self.memory_fd, size)
        return self._map

    def _serve(self) -> None:
        """Serve the rank's newest request, if there is one not served yet. (The rank writes the request's sequence
        number after its fields and the pipe's byte after that: a request read while a newer one is being written is
        left alone, and the newer one's byte wakes this thread again.)"""
        mapping = self._mapping()
        if mapping is None or _word(mapping, 0) != MAGIC:
            return
        seq = _word(mapping, FORWARD_BASE + FORWARD_SEQ)
        if seq <= self._done:
            return
        tag, index = _word(mapping, FORWARD_BASE + FORWARD_TAG), _word(mapping, FORWARD_BASE + FORWARD_SLOT)
        nbytes = _word(mapping, FORWARD_BASE + FORWARD_BYTES)
        raw = bytes(mapping[ADDRESS_AT : ADDRESS_AT + ADDRESS_BYTES]).rstrip(b"\0")
        if _word(mapping, FORWARD_BASE + FORWARD_SEQ) != seq:
            return  # the rank wrote a newer request meanwhile: its byte comes next
        result, began = UNSENT, time.thread_time()
        try:
            slot_bytes = (len(mapping) - HEADER_BYTES) // 2
            if index not in (0, 1) or not 0 < nbytes <= min(slot_bytes, MAX_PAYLOAD) or not raw:
                raise ValueError(f"a forward request that does not fit this memory (slot {index}, {nbytes} bytes)")
            words = [_word(mapping, word_index(index, w)) for w in range(SLOT_WORDS)]

            def intact() -> bool:
                return _word(mapping, word_index(index, STATE)) == VALID and \
                    _word(mapping, word_index(index, TAG)) == tag

            if not intact():
                raise ValueError(f"the copy of step {tag} is no longer in slot {index}")
            address, secret = raw.decode(), self._secret()
            client = self._clients.get(address)
            if client is None or client.secret != secret:
                if client is not None:
                    client.close()
                client = self._clients[address] = RelayClient(address, secret, self.node, self.local_rank,
                                                              SEND_TIMEOUT_S, self.read_fd)
            start = slot_offset(slot_bytes, index)
            with memoryview(mapping)[start : start + nbytes] as view:
                result = client.send(view, _word(mapping, 1), words, intact)
            if result >= 0:
                self.sent += 1
        except Superseded:  # the rank asked for the next one (its wait for this one ended): that one is served
            pass
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self._notice(f"local rank {self.local_rank}: buddy copy of step {tag} not sent ({e})")
        finally:
            self.send_cpu_s += time.thread_time() - began
            _put(mapping, FORWARD_BASE + FORWARD_RESULT, result)
            _put(mapping, FORWARD_BASE + FORWARD_DONE, seq)  # last: the rank reads the result after it
            self._done = seq

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            os.close(self.write_fd)
        self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
        for client in self._clients.values():
            client.close()
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


def _word(mapping: mmap.mmap, index: int) -> int:
    return int(_WORD.unpack_from(mapping, index * 8)[0])


def _put(mapping: mmap.mmap, index: int, value: int) -> None:
    _WORD.pack_into(mapping, index * 8, value)


def new_node_key() -> int:
    """This worker's key for its ranks' copies at the buddies' relays (with the local rank)."""
    return secrets.randbits(62)
