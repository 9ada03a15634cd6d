"""One authenticated TCP connection to a peer rank: framed, zero-copy sends and receives.

Small frames are sent inline from the calling thread; large ones go through a per-peer sender
thread so that sending, receiving and reducing overlap (socket calls release the GIL). Receives
of small frames spin briefly on non-blocking reads before blocking, which halves latency.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import deque

from axond.distributed.wire import HEADER, HEADER_SIZE

INLINE_SEND_BYTES = 64 << 10
"""Frames up to this size are sent from the calling thread (they fit the socket buffer)."""
SOCKET_BUFFER_BYTES = 4 << 20
RECV_WAKEUP = 0.25
"""A blocked receive wakes this often to check the op's deadline."""


class PeerError(Exception):
    """A transport failure with peer group rank `peer`; the backend turns it into `DistributedError`."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class PeerClosed(PeerError):
    """The peer closed the connection or the link failed."""


class PeerTimeout(PeerError):
    """The peer did not send or accept data in time."""


def tune_socket(sock: socket.socket, timeout: float) -> None:
    """Blocking socket with kernel-side timeouts, no Nagle delay and large buffers."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(timeout, RECV_WAKEUP)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))


def _timeval(seconds: float) -> bytes:
    seconds = max(min(seconds, 10**6), 0.001)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Peer:
    """Framed connection to group rank `rank`; one per peer, owned by one backend."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float, spin: float, spin_yield: bool = True) -> None:
        self.sock = sock
        self.rank = rank
        self.timeout = timeout
        self.spin = spin
        self.spin_yield = spin_yield
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview | None, int]] = deque()
        self._posted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        tune_socket(sock, timeout)

    def send(self, header: bytes, payload: memoryview | None) -> int:
        """Queue one frame; small ones go out now. Returns a ticket for `wait_sent`."""
        nbytes = 0 if payload is None else payload.nbytes
        with self._cond:
            if self._error is not None:
                raise PeerClosed(str(self._error), self.rank) from self._error
            self._posted += 1
            ticket = self._posted
            inline = nbytes <= INLINE_SEND_BYTES and self._done == ticket - 1
            if not inline:
                self._queue.append((header, payload, ticket))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._sender, name=f"axond-send-{self.rank}", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return ticket
        try:
            with self._lock:
                self._write(header, payload)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        with self._cond:
            self._done = ticket
            self._cond.notify_all()
        return ticket

    def _write(self, header: bytes, payload: memoryview | None) -> None:
        try:
            if payload is None or payload.nbytes == 0:
                self.sock.sendall(header)
                return
            sent = self.sock.sendmsg([header, payload])
            if sent < HEADER_SIZE:
                self.sock.sendall(memoryview(header)[sent:])
                sent = HEADER_SIZE
            if sent - HEADER_SIZE < payload.nbytes:
                self.sock.sendall(payload[sent - HEADER_SIZE :])
        except (BlockingIOError, TimeoutError) as e:
            raise PeerTimeout(f"sending to peer {self.rank} blocked for {self.timeout:.1f} s", self.rank) from e
        except OSError as e:
            raise PeerClosed(f"send to peer {self.rank} failed: {e}", self.rank) from e

    def _sender(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(1.0)
                if self._closed and not self._queue:
                    return
                header, payload, ticket = self._queue.popleft()
            try:
                with self._lock:
                    self._write(header, payload)
            except BaseException as e:
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._done = ticket
                self._cond.notify_all()

    def wait_sent(self, ticket: int, deadline: float) -> None:
        """Block until frame `ticket` (and all before it) left this process's buffers."""
        with self._cond:
            while self._done < ticket:
                if self._error is not None:
                    raise PeerClosed(str(self._error), self.rank) from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(f"send to peer {self.rank} did not complete", self.rank)
                self._cond.wait(min(left, 1.0))

    def flush(self, deadline: float) -> None:
        """Block until every queued frame was sent."""
        self.wait_sent(self._posted, deadline)

    def recv_header(self, deadline: float) -> tuple[int, ...]:
        """Receive and unpack the next frame header."""
        self.recv_into(self._hdr_view, deadline)
        return HEADER.unpack(self._hdr)

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill `view` exactly from the stream (straight into the caller's buffer)."""
        total = view.nbytes
        got = 0
        sock = self.sock
        if self.spin > 0 and total <= INLINE_SEND_BYTES:
            stop = time.perf_counter() + self.spin
            while got < total:
                try:
                    n = sock.recv_into(view[got:], total - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() > stop:
                        break
                    if self.spin_yield:
                        os.sched_yield()
                    continue
                except OSError as e:
                    raise PeerClosed(f"receive from peer {self.rank} failed: {e}", self.rank) from e
                if n == 0:
                    raise PeerClosed(f"peer {self.rank} closed the connection", self.rank)
                got += n
        while got < total:
            try:
                n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise PeerTimeout(f"no data from peer {self.rank}", self.rank) from e
                continue
            except OSError as e:
                raise PeerClosed(f"receive from peer {self.rank} failed: {e}", self.rank) from e
            if n == 0:
                raise PeerClosed(f"peer {self.rank} closed the connection", self.rank)
            got += n
            if got < total and time.monotonic() >= deadline:
                raise PeerTimeout(f"data from peer {self.rank} stopped arriving", self.rank)

    def try_send_now(self, frame: bytes) -> None:
        """Best effort, never blocking for long: used to tell a peer that this rank aborts."""
        if self._lock.acquire(timeout=0.2):
            try:
                self.sock.send(frame, socket.MSG_DONTWAIT)
            except OSError:
                pass
            finally:
                self._lock.release()

    def shutdown_write(self) -> None:
        """Send EOF after what is queued: the peer sees it once it read everything before."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """Stop the sender thread and close the socket; idempotent."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
