"""`TCPStore`: a small key-value store served over TCP by one rank, for runs without a coordinator.

What `init_process_group(init_method="env://" | "tcp://host:port")` uses when no coordinator is set,
like torch's TCPStore: rank 0 serves the store on MASTER_PORT (`axond.store.tcp_server`)
and every rank (rank 0 too, without a socket) uses it. Each in-flight call holds its own pooled
connection, so one thread's blocking wait does not hold up another's set. With a job secret both
ends prove they know it (HMAC challenge) before any request; without one the store trusts the
network, as torch's TCPStore does.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from axond.store.tcp_server import (
    ADD, COMPARE_SET, DELETE, ERROR, GET, IDLE_TIMEOUT, IO_TIMEOUT, MAGIC, MAX_CONNECTIONS, NAMES, OK, SET, TIMEOUT,
    TRY_GET, WAIT, StoreServer, pack, prove, read_frame, unpack,
)
from axond.errors import StoreError, StoreTimeout
from axond.store.base import Store, check_delta, check_key, check_keys, check_timeout, check_value
from axond.store.memory import InMemoryStore

POOL_SIZE = 8
"""Connections one client keeps (each in-flight call, e.g. a blocking wait, holds one)."""


def _key(key: str) -> bytes:
    return check_key(key).encode()


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
        self._server: StoreServer | None = None
        self._local: InMemoryStore | None = None
        if is_server:
            self._local = InMemoryStore()
            self._server = StoreServer(self._local, _bindable(host), port, self.secret, max_connections)
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
        except (OSError, ConnectionError) as e:
            sock.close()
            raise StoreError(f"TCP store at {self.address}: the connection failed during the greeting ({e})") from e
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        code, f = unpack(read_frame(sock))
        if code == ERROR:
            raise StoreError(f"TCP store at {self.address} refused the connection: {f[0].decode(errors='replace')}")
        if len(f) != 3 or f[0] != MAGIC:
            raise StoreError(f"{self.address} is not an axond TCP store (another service on MASTER_PORT?)")
        if (f[2] == b"1") != bool(self.secret):
            raise StoreError(f"TCP store at {self.address}: one side has a job secret and the other not; "
                             "set AXOND_JOB_SECRET alike on every rank (or on none)")
        if not self.secret:
            return
        mine = os.urandom(16)
        sock.sendall(pack(OK, prove(self.secret, f[1], b"client"), mine))
        code, g = unpack(read_frame(sock))
        if code != OK or len(g) != 1 or not hmac.compare_digest(g[0], prove(self.secret, mine, b"server")):
            raise StoreError(f"TCP store at {self.address}: authentication failed; the job secrets differ")

    def _acquire(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._closed:
                    raise StoreError(f"TCP store at {self.address} is closed")
                now = time.monotonic()
                while self._idle and now - self._idle[0][0] > IDLE_TIMEOUT / 2:  # oldest first
                    self._idle.pop(0)[1].close()
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
            sock.sendall(pack(code, *fields))
            status, out = unpack(read_frame(sock))
        except (OSError, ConnectionError) as e:
            self._drop(sock)
            raise StoreError(f"TCP store at {self.address}: {NAMES[code]} failed ({e}); "
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
        raw = check_value(check_key(key), value)
        if self._local is not None:
            self._local.set(key, raw)
            return
        self._call(SET, [_key(key), raw])

    def get(self, key: str, timeout: float) -> bytes:
        if self._local is not None:
            return self._local.get(key, timeout)
        seconds = check_timeout(timeout)
        return self._call(GET, [_key(key), struct.pack("!d", seconds)], wait=seconds)[0]

    def try_get(self, key: str) -> bytes | None:
        if self._local is not None:
            return self._local.try_get(key)
        out = self._call(TRY_GET, [_key(key)])
        return out[0] if out else None

    def add(self, key: str, delta: int) -> int:
        if self._local is not None:
            return self._local.add(key, delta)
        return int(self._call(ADD, [_key(key), str(check_delta(key, delta)).encode()])[0])

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        raw = check_value(check_key(key), desired)
        if self._local is not None:
            return self._local.compare_set(key, expected, raw)
        want = b"" if expected is None else b"=" + check_value(key, expected)
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
        names = [_key(k) for k in check_keys(keys)]
        seconds = check_timeout(timeout)
        self._call(WAIT, [struct.pack("!d", seconds), *names], wait=seconds)

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
