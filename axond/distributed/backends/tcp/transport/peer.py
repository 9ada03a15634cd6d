"""One authenticated TCP connection to a peer rank, which alone reads and writes its socket: framed, zero-copy sends and
receives.

Sends go through the peer's `Outbox` (`outbox`: inline, or by a sender thread). Receives of small frames
spin briefly on non-blocking reads (yielding the CPU) before blocking, which halves latency, unless
this host's ranks outnumber its cores (`oversubscribed`): then spinning only steals the peer's core.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp.policy import INLINE_SEND_BYTES, SMALL_FRAME
from axond.distributed.backends.tcp.transport.errors import PeerClosed, PeerError, PeerTimeout
from axond.distributed.backends.tcp.transport.outbox import Outbox
from axond.distributed.backends.tcp.transport.sockets import CONGESTION, RTO_MAX_MS, tune_socket
from axond.distributed.backends.tcp.transport.wire import HEADER, HEADER_SIZE, Kind

__all__ = ["Peer", "PeerClosed", "PeerError", "PeerTimeout", "wait_readable"]


class Peer:
    """Framed connection to group rank `rank`; one per peer, owned by one backend."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float, spin: float, spin_yield: bool = True,
                 try_inline_bytes: int = 0, buffer_bytes: int = 0, rto_max_ms: int = RTO_MAX_MS,
                 congestion: str = CONGESTION) -> None:
        self.sock = sock
        self.rank = rank
        self.timeout = timeout
        self.spin = spin
        self.spin_yield = spin_yield
        self.outbox = out = Outbox(sock, rank, timeout, try_inline_bytes)
        """The sending half; its methods are this peer's (`send`, `wait_sent`, ...)."""
        self.write_lock = out.write_lock
        """Held by whoever writes to the socket (the op thread's inline sends, the sender thread, a `Swap`)."""
        self.send = out.send
        self.wait_sent = out.wait_sent
        self.sent_through = out.sent_through
        self.flush = out.flush
        self.acquire_writer = out.acquire_writer
        self.send_some = out.send_some
        self.try_send_now = out.try_send_now
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._small = bytearray(HEADER_SIZE + SMALL_FRAME)
        self._small_view = memoryview(self._small)
        self._got = 0
        self._small_arrays: dict[tuple[np.dtype, int], np.ndarray] = {}
        self.early: deque[tuple[tuple[int, ...], bytearray]] = deque()
        """Point-to-point frames (header, payload) that arrived while a collective waited for its own: the peer sent
        them first, this rank receives them after the collective. Later receives from this peer take them first."""
        self._idle: Callable[[], None] | None = None
        tune_socket(sock, timeout, buffer_bytes, rto_max_ms, congestion)

    @property
    def idle(self) -> Callable[[], None] | None:
        """Run each time a blocking wait wakes up without progress (every RECV_WAKEUP); may raise to end it."""
        return self._idle

    @idle.setter
    def idle(self, hook: Callable[[], None] | None) -> None:
        self._idle = self.outbox.idle = hook

    def recv_header(self, deadline: float, collective: bool = False) -> tuple[int, ...]:
        """Receive and unpack the next frame header (of a large frame: no busy-polling); for a `collective`, the
        next one that is not a point-to-point frame, which are set aside (`early`)."""
        while True:
            self.recv_into(self._hdr_view, deadline, spin=False)
            header = HEADER.unpack(self._hdr)
            if not collective or header[0] != Kind.P2P:
                return header
            self.set_aside(header, memoryview(b""), deadline)

    def set_aside(self, header: tuple[int, ...], have: memoryview, deadline: float) -> None:
        """Keep point-to-point frame `header`, whose payload starts with `have`, for a later receive (see `early`)."""
        data = bytearray(header[8])
        take = min(have.nbytes, len(data))
        data[:take] = have[:take]
        if take < len(data):
            self.recv_into(memoryview(data)[take:], deadline, spin=False)
        self.early.append((header, data))

    def recv_small(self, nbytes: int, deadline: float, collective: bool = False) -> tuple[tuple[int, ...], memoryview]:
        """Receive a frame expected to carry `nbytes` (<= SMALL_FRAME) with as few calls as possible.

        Returns the header and the payload bytes read; if the header announces another size, only
        the header (and whatever arrived with it, at most `nbytes`) is returned. For a `collective`,
        point-to-point frames before it are set aside (`early`).
        """
        buf = self._small_view
        total = HEADER_SIZE + nbytes
        # blocking without spin; with spin one non-blocking try first (a frame already there costs one call)
        got = self._recv_once(buf, total, 0 if self.spin <= 0 else socket.MSG_DONTWAIT)
        while True:
            if got < HEADER_SIZE:
                self.recv_into(buf[got:HEADER_SIZE], deadline, want=total - got, into=buf[got:])
                got += self._got
            header = HEADER.unpack_from(self._small)
            if not collective or header[0] != Kind.P2P:
                break
            end = HEADER_SIZE + header[8]
            self.set_aside(header, buf[HEADER_SIZE : min(got, end)], deadline)
            rest = bytes(buf[end:got]) if got > end else b""  # the start of the next frame
            buf[: len(rest)] = rest
            got = len(rest)
        if header[8] == nbytes and got < total:
            self.recv_into(buf[got:total], deadline)
            got = total
        return header, buf[HEADER_SIZE:got]

    def small_array(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The payload of the last `recv_small` as a typed array: a view of this peer's receive buffer,
        valid until the next receive from this peer."""
        key = (dtype, count)
        a = self._small_arrays.get(key)
        if a is None:
            if len(self._small_arrays) >= 64:
                self._small_arrays.clear()
            a = self._small_arrays[key] = np.frombuffer(self._small, dtype, count, HEADER_SIZE)
        return a

    def _recv_once(self, buf: memoryview, limit: int, flags: int = 0) -> int:
        """One read of up to `limit` bytes (0 if the wake-up timeout passed first, or nothing was there)."""
        try:
            n = self.sock.recv_into(buf, limit, flags)
        except (BlockingIOError, TimeoutError, InterruptedError):
            return 0
        except OSError as e:
            raise PeerClosed(f"receive from peer {self.rank} failed: {e}", self.rank) from e
        if n == 0:
            raise PeerClosed(f"peer {self.rank} closed the connection", self.rank)
        return n

    def recv_into(self, view: memoryview, deadline: float, want: int = 0, into: memoryview | None = None,
                  spin: bool = True) -> None:
        """Fill `view` exactly from the stream (straight into the caller's buffer).

        With `into`/`want`: read up to `want` bytes into `into` (a larger buffer starting with
        `view`), stopping as soon as `view` is full; the count is left in `self._got`.
        """
        total = view.nbytes
        if into is not None:
            view, limit = into, want
        else:
            limit = total
        got = 0
        sock = self.sock
        if spin and self.spin > 0 and total <= INLINE_SEND_BYTES:
            stop = 0.0
            while got < total:
                try:
                    n = sock.recv_into(view[got:], limit - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    now = time.perf_counter()
                    if not stop:
                        stop = now + self.spin
                    elif now > stop:
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
                n = sock.recv_into(view[got:], limit - got, 0 if into is not None else socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise PeerTimeout(f"no data from peer {self.rank}", self.rank) from e
                if self.idle is not None:
                    self.idle()
                continue
            except OSError as e:
                raise PeerClosed(f"receive from peer {self.rank} failed: {e}", self.rank) from e
            if n == 0:
                raise PeerClosed(f"peer {self.rank} closed the connection", self.rank)
            got += n
            if got < total and time.monotonic() >= deadline:
                raise PeerTimeout(f"data from peer {self.rank} stopped arriving", self.rank)
        self._got = got

    def recv_some(self, view: memoryview) -> int:
        """Read what has arrived, up to `view`'s size, without blocking; 0 if nothing is there yet."""
        try:
            n = self.sock.recv_into(view, view.nbytes, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise PeerClosed(f"receive from peer {self.rank} failed: {e}", self.rank) from e
        if n == 0:
            raise PeerClosed(f"peer {self.rank} closed the connection", self.rank)
        return n

    def peek(self, limit: int) -> bytes:
        """Up to `limit` unread bytes, left unread; never blocks (empty if none, or the link failed)."""
        try:
            return self.sock.recv(limit, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return b""

    def readable(self) -> bool:
        """Whether something (a frame, EOF) is there to read now."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown_write(self) -> None:
        """Send EOF after what is queued: the peer sees it once it read everything before."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def shutdown(self) -> None:
        """Shut the socket down both ways, from any thread: a receive or send blocked on it returns at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Stop the sender thread and close the socket; idempotent."""
        self.outbox.stop()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.outbox.join()


def wait_readable(peers: list[Peer], timeout: float) -> list[Peer]:
    """The `peers` with something to read within `timeout` seconds (all of them idle: an empty list)."""
    if not peers:
        return []
    ready, _, _ = select.select(peers, [], [], timeout)
    return ready
