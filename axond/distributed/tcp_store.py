"""`TCPStore`: a small key-value store served over TCP by one rank, for runs without a coordinator.

What `init_process_group(init_method="env://" | "tcp://host:port")` uses when no coordinator is set,
like torch's TCPStore: rank 0 serves the store on MASTER_PORT and every rank (rank 0 too, without a
socket) uses it. Everything is bounded: frame and key sizes, keys per request, connections, and every
socket read. With a job secret both ends prove they know it (HMAC challenge) before any request;
without one the store trusts the network, as torch's TCPStore does.

Frames are a 4-byte big-endian length, then the payload: one op (or status) byte and length-prefixed
fields. The server keeps the data in an `InMemoryStore`, so its semantics are that store's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from axond.errors import StoreError, StoreTimeout
from axond.store import MAX_VALUE_BYTES, InMemoryStore, Store

MAX_KEY_BYTES = 4096
"""Longest key accepted (UTF-8 bytes)."""
MAX_KEYS = 1024
"""Most keys one `wait` may name."""
MAX_FRAME = 2 * MAX_VALUE_BYTES + 64 * 1024
"""Largest frame either side accepts (a compare_set carries two values)."""
MAX_CONNECTIONS = 1024
"""Connections the server holds at once; more are told so and closed."""
IO_TIMEOUT = 30.0
"""Seconds one request or reply may take on the wire (waits add their own timeout)."""
IDLE_TIMEOUT = 600.0
"""Seconds the server keeps a silent connection; clients drop theirs after half of it."""
POOL_SIZE = 8
"""Connections one client keeps (each in-flight call, e.g. a blocking wait, holds one)."""
_MAGIC = b"axond-tcp-store-1"

SET, GET, TRY_GET, ADD, COMPARE_SET, DELETE, WAIT = range(1, 8)
OK, TIMEOUT, ERROR = range(3)
_NAMES = {SET: "set", GET: "get", TRY_GET: "try_get", ADD: "add", COMPARE_SET: "compare_set", DELETE: "delete",
          WAIT: "wait"}


def _pack(code: int, *fields: bytes) -> bytes:
    body = bytes([code]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!I", len(body)) + body


def _unpack(body: bytes) -> tuple[int, list[bytes]]:
    if not body:
        raise StoreError("TCP store: empty frame")
    fields: list[bytes] = []
    at = 1
    while at < len(body):
        if at + 4 > len(body) or len(fields) > MAX_KEYS + 2:
            raise StoreError("TCP store: malformed frame")
        (n,) = struct.unpack_from("!I", body, at)
        if at + 4 + n > len(body):
            raise StoreError("TCP store: malformed frame")
        fields.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    return body[0], fields


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise StoreError(f"TCP store: frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return _recv_exact(sock, n)


def _key(key: str) -> bytes:
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise StoreError(f"store key must be 1..{MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def _value(key: str, value: bytes) -> bytes:
    if len(value) > MAX_VALUE_BYTES:
        raise StoreError(f"store value for {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}")
    return bytes(value)


def _prove(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(secret, _MAGIC + role + nonce, hashlib.sha256).digest()


class _Server:
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
            conn.sendall(_pack(ERROR, f"the store holds {self.max_connections} connections already".encode()))
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
                (n,) = struct.unpack("!I", _recv_exact(conn, 4))
                conn.settimeout(IO_TIMEOUT)
                if n > MAX_FRAME:
                    conn.sendall(_pack(ERROR, f"frame of {n} bytes is over the {MAX_FRAME}-byte limit".encode()))
                    return
                code, fields = _unpack(_recv_exact(conn, n))
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
        conn.sendall(_pack(OK, _MAGIC, nonce, b"1" if self.secret else b"0"))
        if not self.secret:
            return True
        _, fields = _unpack(_read_frame(conn))
        if len(fields) != 2 or not hmac.compare_digest(fields[0], _prove(self.secret, nonce, b"client")):
            conn.sendall(_pack(ERROR, b"authentication failed: the job secrets differ"))
            return False
        conn.sendall(_pack(OK, _prove(self.secret, fields[1], b"server")))
        return True

    def _answer(self, code: int, f: list[bytes]) -> bytes:
        try:
            return _pack(OK, *self._apply(code, f))
        except StoreTimeout as e:
            return _pack(TIMEOUT, str(e).encode())
        except (StoreError, ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
            return _pack(ERROR, str(e).encode() or type(e).__name__.encode())

    def _apply(self, code: int, f: list[bytes]) -> list[bytes]:
        d = self.data
        if code == WAIT:
            d.wait([k.decode() for k in f[1:]], _seconds(f[0]))
            return []
        key = f[0].decode()
        if code == SET:
            d.set(key, f[1])
            return []
        if code == GET:
            return [d.get(key, _seconds(f[1]))]
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


def _seconds(raw: bytes) -> float:
    (t,) = struct.unpack("!d", raw)
    if not 0 <= t <= 7 * 86400:
        raise StoreError(f"store timeout {t} s is outside 0..7 days")
    return float(t)


class TCPStore(Store):
    """A `Store` kept by the rank that serves it (`is_server=True`) and reached by the others over TCP.

    `timeout` bounds the first connection (the server may start later) and every call without its own
    wait. `secret` (the job secret) authenticates both ends; empty: unauthenticated, trust the network.
    """

    def __init__(self, host: str, port: int, is_server: bool = False, timeout: float = 300.0, secret: bytes = b"",
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if not timeout > 0:
            raise StoreError(f"TCP store timeout must be positive seconds, got {timeout!r}")
        self.host, self.timeout, self.secret = host, float(timeout), bytes(secret)
        self._server: _Server | None = None
        self._local: InMemoryStore | None = None
        if is_server:
            self._local = InMemoryStore()
            self._server = _Server(self._local, _bindable(host), port, self.secret, max_connections)
            port = self._server.port
        self.port = port
        self._idle: list[tuple[float, socket.socket]] = []
        self._open = 0
        self._cond = threading.Condition()
        self._closed = False
        if self._local is None:  # fail here, not at first use, when the server never comes
            first = self._connect(time.monotonic() + self.timeout)
            self._open = 1
            self._release(first)

    @property
    def address(self) -> str:
        """host:port of the server."""
        return f"{self.host}:{self.port}"

    def _connect(self, deadline: float) -> socket.socket:
        """Connect and authenticate, retrying refused connections until `deadline` (the server may start later)."""
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(IO_TIMEOUT, self.timeout))
                break
            except OSError as e:
                if time.monotonic() + delay >= deadline:
                    raise StoreError(f"TCP store at {self.address} is unreachable after {self.timeout:.1f} s: {e}; "
                                     "is rank 0 running and MASTER_ADDR/MASTER_PORT right?") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IO_TIMEOUT)
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        try:
            code, f = _unpack(_read_frame(sock))
        except (OSError, ConnectionError) as e:
            raise StoreError(f"TCP store at {self.address}: no greeting ({e})") from e
        if code == ERROR:
            raise StoreError(f"TCP store at {self.address} refused the connection: {f[0].decode(errors='replace')}")
        if len(f) != 3 or f[0] != _MAGIC:
            raise StoreError(f"{self.address} is not an axond TCP store (another service on MASTER_PORT?)")
        if (f[2] == b"1") != bool(self.secret):
            raise StoreError(f"TCP store at {self.address}: one side has a job secret and the other not; "
                             "set AXOND_JOB_SECRET alike on every rank (or on none)")
        if not self.secret:
            return
        mine = os.urandom(16)
        sock.sendall(_pack(OK, _prove(self.secret, f[1], b"client"), mine))
        code, g = _unpack(_read_frame(sock))
        if code != OK or len(g) != 1 or not hmac.compare_digest(g[0], _prove(self.secret, mine, b"server")):
            raise StoreError(f"TCP store at {self.address}: authentication failed; the job secrets differ")

    def _acquire(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._closed:
                    raise StoreError(f"TCP store at {self.address} is closed")
                now = time.monotonic()
                while self._idle and now - self._idle[-1][0] > IDLE_TIMEOUT / 2:
                    self._idle.pop()[1].close()
                    self._open -= 1
                if self._idle:
                    return self._idle.pop()[1]
                if self._open < POOL_SIZE:
                    self._open += 1
                    break
                if not self._cond.wait(max(0.0, deadline - now)) and time.monotonic() >= deadline:
                    raise StoreTimeout(f"TCP store at {self.address}: all {POOL_SIZE} connections stayed busy "
                                       f"for {self.timeout:.1f} s")
        try:
            return self._connect(deadline)
        except BaseException:
            self._drop(None)
            raise

    def _release(self, sock: socket.socket) -> None:
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._idle.append((time.monotonic(), sock))
            self._cond.notify()

    def _drop(self, sock: socket.socket | None) -> None:
        if sock is not None:
            sock.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def _call(self, code: int, fields: Sequence[bytes], wait: float = 0.0) -> list[bytes]:
        sock = self._acquire()
        try:
            sock.settimeout(IO_TIMEOUT + wait)
            sock.sendall(_pack(code, *fields))
            status, out = _unpack(_read_frame(sock))
        except (OSError, ConnectionError) as e:
            self._drop(sock)
            raise StoreError(f"TCP store at {self.address}: {_NAMES[code]} failed ({e}); "
                             "the serving rank (rank 0) may have exited") from e
        except BaseException:
            self._drop(sock)
            raise
        self._release(sock)
        if status == TIMEOUT:
            raise StoreTimeout(out[0].decode(errors="replace"))
        if status != OK:
            raise StoreError(f"TCP store at {self.address}: {out[0].decode(errors='replace') if out else 'error'}")
        return out

    def set(self, key: str, value: bytes) -> None:
        raw = _value(key, value)
        if self._local is not None:
            self._local.set(key, raw)
            return
        self._call(SET, [_key(key), raw])

    def get(self, key: str, timeout: float) -> bytes:
        if self._local is not None:
            return self._local.get(key, timeout)
        return self._call(GET, [_key(key), struct.pack("!d", timeout)], wait=timeout)[0]

    def try_get(self, key: str) -> bytes | None:
        if self._local is not None:
            return self._local.try_get(key)
        out = self._call(TRY_GET, [_key(key)])
        return out[0] if out else None

    def add(self, key: str, delta: int) -> int:
        if self._local is not None:
            return self._local.add(key, delta)
        return int(self._call(ADD, [_key(key), str(int(delta)).encode()])[0])

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        raw = _value(key, desired)
        if self._local is not None:
            return self._local.compare_set(key, expected, raw)
        want = b"" if expected is None else b"=" + _value(key, expected)
        out = self._call(COMPARE_SET, [_key(key), want, raw])
        return out[0] == b"1", (out[1] if len(out) > 1 else None)

    def delete(self, key: str) -> bool:
        if self._local is not None:
            return self._local.delete(key)
        return self._call(DELETE, [_key(key)])[0] == b"1"

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        if self._local is not None:
            self._local.wait(keys, timeout)
            return
        if len(keys) > MAX_KEYS:
            raise StoreError(f"a store wait may name {MAX_KEYS} keys at most, got {len(keys)}")
        self._call(WAIT, [struct.pack("!d", timeout), *(_key(k) for k in keys)], wait=timeout)

    def close(self, linger: float = 0.0) -> None:
        """Close this client's connections; the serving rank also stops the server, once the other ranks
        disconnected (waiting at most `linger` seconds), so that ranks still finishing keep their store."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for _, sock in idle:
            sock.close()
        if self._server is not None:
            self._server.close(linger)
            self._server = None


def _bindable(host: str) -> str:
    """`host` if this machine has that address, else every interface (as torch's TCPStore binds)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return host
    except OSError:
        return ""
