"""The data plane's handshake: wire format, proofs, and the acceptor that serves every pending handshake at once.

A connecting rank sends HELLO (group, its rank, group size, a nonce); the acceptor answers with
CHALLENGE (its nonce and its proof); the connector sends its proof; the acceptor sends a verdict
byte. Both proofs are HMAC-SHA256 over the job secret, both nonces, the group and both ranks, with
a role byte so neither side's proof can be replayed as the other's. Every message has a fixed size,
so a peer declares no length and nothing is allocated on its say-so.

The acceptor runs every pending handshake from one selector loop: a slow or silent connection
never delays another, each has one overall deadline (`handshake_timeout`) after which it is
dropped, and at most MAX_PENDING are pending at once (the oldest is dropped for a newcomer, so a
flood of idle connections costs a legitimate member at most a retry).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import threading
import time

MAGIC = b"AXD1"
HELLO = struct.Struct("<4sIii16s")
"""magic, group id, connecting rank, group size, connector nonce."""
CHALLENGE = struct.Struct("<4sB16s32s")
"""magic, status, acceptor nonce, acceptor proof."""
PROOF_SIZE = 32
ACCEPTED, REFUSED = 1, 2
HANDSHAKE_TIMEOUT = 5.0
"""Default seconds an incoming connection has to complete the whole handshake before it is dropped."""
MAX_PENDING = 64
"""Most unauthenticated connections a forming rank holds at once; beyond it the oldest is dropped."""
KEEP, DROP, REFUSE = -1, -2, -3
"""`Acceptor._advance` results other than an authenticated peer rank: wait, close, close as refused."""
POLL = 0.1
"""Longest the accept loop sleeps before it checks deadlines and the stop flag again."""


def proof(secret: bytes, role: bytes, first: bytes, second: bytes, gid: int, a: int, b: int) -> bytes:
    """HMAC of one side of the handshake: role (b"A" acceptor, b"C" connector), nonces, group, connector a,
    acceptor b."""
    return hmac.new(secret, role + first + second + struct.pack("<Iii", gid, a, b), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes from a blocking socket by `deadline` (monotonic), else TimeoutError or ConnectionError."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake did not finish in time")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def _send_nowait(sock: socket.socket, data: bytes) -> bool:
    """Send a handshake message on a non-blocking socket; False if it did not all fit (only a peer that never reads)."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


class _Pending:
    """One connection in the middle of its handshake."""

    __slots__ = ("sock", "deadline", "buf", "peer", "peer_nonce", "nonce")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.peer: int | None = None
        """The rank the HELLO claimed, once it was read and plausible."""
        self.peer_nonce = b""
        self.nonce = secrets.token_bytes(16)


class Acceptor:
    """Accepts the higher ranks of a forming group on `listener`, authenticating them concurrently."""

    def __init__(self, listener: socket.socket, secret: bytes, gid: int, rank: int, size: int,
                 handshake_timeout: float) -> None:
        self.listener = listener
        self.secret = secret
        self.gid = gid
        self.rank = rank
        self.size = size
        self.handshake_timeout = handshake_timeout
        self.refused = 0
        """Connections that failed the checks or the proof."""
        self.dropped = 0
        """Connections dropped unanswered: closed, timed out, or pushed out by newer ones."""
        self._sel = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Pending] = {}

    def run(self, expected: set[int], socks: dict[int, socket.socket], deadline: float, stop: threading.Event) -> None:
        """Put an authenticated socket in `socks` for every rank of `expected`, until done, `deadline` or `stop`."""
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        try:
            while expected and not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    return
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    self._drop(p)
                wake = min([deadline, now + POLL, *(p.deadline for p in self._pending.values())])
                for key, _ in self._sel.select(max(0.0, wake - now)):
                    if key.fileobj is self.listener:
                        self._accept()
                        continue
                    p = self._pending.get(key.fileobj)  # type: ignore[call-overload]
                    if p is None:  # pushed out by a newcomer earlier in this batch
                        continue
                    peer = self._advance(p, expected)
                    if peer in (DROP, REFUSE):
                        self._drop(p, refused=peer == REFUSE)
                    elif peer >= 0:
                        self._forget(p)
                        p.sock.setblocking(True)
                        expected.discard(peer)
                        socks[peer] = p.sock
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            self._sel.close()

    def _accept(self) -> None:
        """Take every connection waiting on the listener, dropping the oldest pending ones beyond MAX_PENDING."""
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self._pending:  # out of descriptors: free one for the next try
                    self._drop(next(iter(self._pending.values())))
                else:
                    time.sleep(POLL)
                return
            sock.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending.values())))
            self._pending[sock] = _Pending(sock, time.monotonic() + self.handshake_timeout)
            self._sel.register(sock, selectors.EVENT_READ)

    def _advance(self, p: _Pending, expected: set[int]) -> int:
        """Read what `p`'s peer sent and answer it: its rank once it proved the secret, else KEEP, DROP or REFUSE."""
        want = HELLO.size if p.peer is None else PROOF_SIZE
        try:
            chunk = p.sock.recv(want - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return KEEP
        except OSError:
            return DROP
        if not chunk:
            return DROP
        p.buf += chunk
        if len(p.buf) < want:
            return KEEP
        if p.peer is None:
            magic, gid, peer, size, p.peer_nonce = HELLO.unpack(p.buf)
            p.buf.clear()
            if magic != MAGIC or gid != self.gid or size != self.size or peer not in expected:
                return self._refuse(p, CHALLENGE.pack(MAGIC, REFUSED, p.nonce, bytes(PROOF_SIZE)))
            p.peer = peer
            mine = proof(self.secret, b"A", p.peer_nonce, p.nonce, self.gid, peer, self.rank)
            return KEEP if _send_nowait(p.sock, CHALLENGE.pack(MAGIC, ACCEPTED, p.nonce, mine)) else DROP
        theirs = proof(self.secret, b"C", p.nonce, p.peer_nonce, self.gid, p.peer, self.rank)
        if not hmac.compare_digest(bytes(p.buf), theirs) or p.peer not in expected:
            return self._refuse(p, bytes([REFUSED]))
        return p.peer if _send_nowait(p.sock, bytes([ACCEPTED])) else DROP

    @staticmethod
    def _refuse(p: _Pending, answer: bytes) -> int:
        _send_nowait(p.sock, answer)
        return REFUSE

    def _forget(self, p: _Pending) -> None:
        self._sel.unregister(p.sock)
        del self._pending[p.sock]

    def _drop(self, p: _Pending, refused: bool = False) -> None:
        if refused:
            self.refused += 1
        else:
            self.dropped += 1
        self._forget(p)
        p.sock.close()
