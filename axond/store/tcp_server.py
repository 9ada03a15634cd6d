"""The serving side of `axond.store.tcp.TCPStore`, and the wire format both sides speak.

Frames are a 4-byte big-endian length, then the payload: one op (or status) byte and length-prefixed
fields. The server answers each connection on its own thread from one `InMemoryStore`, so its
semantics are that store's. Everything is bounded: frame sizes, fields per frame, connections, and
every socket read (an idle connection is closed after IDLE_TIMEOUT).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

from axond.errors import StoreError, StoreTimeout
from axond.store.base import MAX_VALUE_BYTES, MAX_WAIT_KEYS, check_timeout
from axond.store.memory import InMemoryStore

MAX_FRAME = 2 * MAX_VALUE_BYTES + 64 * 1024
"""Largest frame either side accepts (a compare_set carries two values)."""
MAX_CONNECTIONS = 1024
"""Connections the server holds at once; more are told so and closed."""
IO_TIMEOUT = 30.0
"""Seconds one request or reply may take on the wire (waits add their own timeout)."""
IDLE_TIMEOUT = 600.0
"""Seconds the server keeps a silent connection; clients drop theirs after half of it."""
MAGIC = b"axond-tcp-store-1"
"""The greeting's first field: tells an axond store from another service on the port."""

SET, GET, TRY_GET, ADD, COMPARE_SET, DELETE, WAIT = range(1, 8)
OK, TIMEOUT, ERROR = range(3)
NAMES = {SET: "set", GET: "get", TRY_GET: "try_get", ADD: "add", COMPARE_SET: "compare_set", DELETE: "delete",
         WAIT: "wait"}
"""Op codes by name, for error messages."""


def pack(code: int, *fields: bytes) -> bytes:
    """One frame: length, `code`, then each field with its length."""
    body = bytes([code]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!I", len(body)) + body


def unpack(body: bytes) -> tuple[int, list[bytes]]:
    """(code, fields) of a frame's payload, or StoreError if it is malformed."""
    if not body:
        raise StoreError("TCP store: empty frame")
    fields: list[bytes] = []
    at = 1
    while at < len(body):
        if at + 4 > len(body) or len(fields) > MAX_WAIT_KEYS + 2:
            raise StoreError("TCP store: malformed frame")
        (n,) = struct.unpack_from("!I", body, at)
        if at + 4 + n > len(body):
            raise StoreError("TCP store: malformed frame")
        fields.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    return body[0], fields


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from `sock` (bounded by its timeout), or ConnectionError if the peer closed."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> bytes:
    """The payload of the next frame, refusing frames over MAX_FRAME."""
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise StoreError(f"TCP store: frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return recv_exact(sock, n)


def prove(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    """The proof that `role` ("client" or "server") knows `secret`, for the other side's `nonce`."""
    return hmac.new(secret, MAGIC + role + nonce, hashlib.sha256).digest()


def wait_seconds(raw: bytes) -> float:
    """A request's wait (a big-endian double), checked as every store checks its timeouts."""
    (t,) = struct.unpack("!d", raw)
    return check_timeout(t)


class StoreServer:
    """Accepts connections and answers each on its own thread from one `InMemoryStore`."""

    def __init__(self, data: InMemoryStore, host: str, port: int, secret: bytes, max_connections: int) -> None:
        self.data = data
        self.secret = secret
        self.max_connections = max_connections
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="axond-tcp-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="axond-tcp-store-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(pack(ERROR, f"the store holds {self.max_connections} connections already".encode()))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn):
                return
            while not self._closed:
                conn.settimeout(IDLE_TIMEOUT)
                (n,) = struct.unpack("!I", recv_exact(conn, 4))
                conn.settimeout(IO_TIMEOUT)
                if n > MAX_FRAME:
                    conn.sendall(pack(ERROR, f"frame of {n} bytes is over the {MAX_FRAME}-byte limit".encode()))
                    return
                code, fields = unpack(recv_exact(conn, n))
                conn.sendall(self._answer(code, fields))
        except (OSError, ConnectionError, StoreError, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        """Greet with a nonce; with a secret, check the client's proof and prove ours for its nonce."""
        nonce = os.urandom(16)
        conn.sendall(pack(OK, MAGIC, nonce, b"1" if self.secret else b"0"))
        if not self.secret:
            return True
        _, fields = unpack(read_frame(conn))
        if len(fields) != 2 or not hmac.compare_digest(fields[0], prove(self.secret, nonce, b"client")):
            conn.sendall(pack(ERROR, b"authentication failed: the job secrets differ"))
            return False
        conn.sendall(pack(OK, prove(self.secret, fields[1], b"server")))
        return True

    def _answer(self, code: int, f: list[bytes]) -> bytes:
        try:
            return pack(OK, *self._apply(code, f))
        except StoreTimeout as e:
            return pack(TIMEOUT, str(e).encode())
        except (StoreError, ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
            return pack(ERROR, str(e).encode() or type(e).__name__.encode())

    def _apply(self, code: int, f: list[bytes]) -> list[bytes]:
        d = self.data
        if code == WAIT:
            d.wait([k.decode() for k in f[1:]], wait_seconds(f[0]))
            return []
        key = f[0].decode()
        if code == SET:
            d.set(key, f[1])
            return []
        if code == GET:
            return [d.get(key, wait_seconds(f[1]))]
        if code == TRY_GET:
            value = d.try_get(key)
            return [] if value is None else [value]
        if code == ADD:
            return [str(d.add(key, int(f[1]))).encode()]
        if code == COMPARE_SET:
            swapped, current = d.compare_set(key, None if f[1] == b"" else f[1][1:], f[2])
            return [b"1" if swapped else b"0"] + ([] if current is None else [current])
        if code == DELETE:
            return [b"1" if d.delete(key) else b"0"]
        raise StoreError(f"unknown TCP store op {code}")

    def close(self, linger: float = 0.0) -> None:
        """Stop serving, after the clients disconnected or `linger` seconds passed."""
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    break
            time.sleep(0.02)
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop now, not at its next poll
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(5.0)
