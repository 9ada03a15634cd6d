"""One authenticated TCP connection to a peer rank, which alone reads and writes its socket: framed, zero-copy sends and
receives.

Small frames are sent inline from the calling thread; mid-sized ones are first written without
blocking (whatever fits the socket buffer); the rest goes through a per-peer sender thread so that
sending, receiving and reducing overlap (socket calls release the GIL). Receives of small frames
spin briefly on non-blocking reads (yielding the CPU) before blocking, which halves latency, unless
this host's ranks outnumber its cores (`oversubscribed`): then spinning only steals the peer's core.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp.policy import INLINE_SEND_BYTES, SMALL_FRAME
from axond.distributed.backends.tcp.transport.sockets import CONGESTION, RECV_WAKEUP, RTO_MAX_MS, tune_socket
from axond.distributed.backends.tcp.transport.wire import HEADER, HEADER_SIZE, Kind



class PeerError(Exception):
    """A transport failure with peer group rank `peer`; the backend turns it into `DistributedError`."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class PeerClosed(PeerError):
    """The peer closed the connection or the link failed."""


class PeerTimeout(PeerError):
    """The peer did not send or accept data in time."""


class Peer:
    """Framed connection to group rank `rank`; one per peer, owned by one backend."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float, spin: float, spin_yield: bool = True,
                 try_inline_bytes: int = 0, buffer_bytes: int = 0, rto_max_ms: int = RTO_MAX_MS,
                 congestion: str = CONGESTION) -> None:
        self.sock = sock
        self.try_inline_bytes = try_inline_bytes
        """Larger frames up to this size are first written without blocking from the calling thread."""
        self.rank = rank
        self.timeout = timeout
        self.spin = spin
        self.spin_yield = spin_yield
        self._lock = threading.Lock()
        self.write_lock = self._lock
        """Held by whoever writes to the socket (the op thread's inline sends, the sender thread, a `Swap`)."""
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview | None, int]] = deque()
        self._posted = 0
        self._post_lock = threading.Lock()
        self._done = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._small = bytearray(HEADER_SIZE + SMALL_FRAME)
        self._small_view = memoryview(self._small)
        self._got = 0
        self._small_arrays: dict[tuple[np.dtype, int], np.ndarray] = {}
        self.early: deque[tuple[tuple[int, ...], bytearray]] = deque()
        """Point-to-point frames (header, payload) that arrived while a collective waited for its own: the peer sent
        them first, this rank receives them after the collective. Later receives from this peer take them first."""
        self.idle: Callable[[], None] | None = None
        """Run each time a blocking wait wakes up without progress (every RECV_WAKEUP); may raise to end it."""
        tune_socket(sock, timeout, buffer_bytes, rto_max_ms, congestion)

    def send(self, header: bytes, payload: memoryview | None) -> int:
        """Queue one frame; small ones go out now. Returns a ticket for `wait_sent`.

        Posting is serialized by `_post_lock` (the op-running thread, and a torch send posted on its caller's thread
        meanwhile), so the inline fast path needs no condition variable: when nothing is queued, the sender thread
        is idle and only the write lock is shared.
        """
        with self._post_lock:
            return self._post(header, payload)

    def _post(self, header: bytes, payload: memoryview | None) -> int:
        if self._error is not None:
            raise self._failure() from self._error
        nbytes = 0 if payload is None else payload.nbytes
        if nbytes <= INLINE_SEND_BYTES and self._done == self._posted:
            self._posted += 1
            ticket = self._posted
            try:
                with self._lock:
                    self._write(header, payload)
            except BaseException as e:
                self._fail(e)
                raise
            self._done = ticket
            return ticket
        if payload is not None and nbytes <= self.try_inline_bytes and self._done == self._posted:
            with self._lock:  # held until the rest is queued: no other writer starts a frame inside this one
                sent = self._try_write(header, payload)
                if sent == HEADER_SIZE + nbytes:
                    self._posted += 1
                    self._done = self._posted
                    return self._posted
                return self._queue_frame(header[sent:], payload[max(0, sent - HEADER_SIZE) :])
        return self._queue_frame(header, payload)

    def _queue_frame(self, header: bytes, payload: memoryview | None) -> int:
        """Hand (the rest of) a frame to the sender thread; its ticket."""
        with self._cond:
            self._posted += 1
            ticket = self._posted
            self._queue.append((header, payload, ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._sender, name=f"axond-send-{self.rank}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return ticket

    def _try_write(self, header: bytes, payload: memoryview) -> int:
        """Send what fits in the socket buffer right now (no thread hand-off; the caller holds `_lock`); returns the
        bytes sent."""
        try:
            return self.send_some([memoryview(header), payload])
        except PeerClosed as e:
            self._error = e
            raise

    def _write(self, header: bytes, payload: memoryview | None) -> None:
        try:
            if payload is None or payload.nbytes == 0:
                self.sock.sendall(header)
                return
            hlen = len(header)
            sent = self.sock.sendmsg([header, payload])
            if sent < hlen:
                self.sock.sendall(memoryview(header)[sent:])
                sent = hlen
            if sent - hlen < payload.nbytes:
                self.sock.sendall(payload[sent - hlen :])
        except (BlockingIOError, TimeoutError) as e:
            raise PeerTimeout(f"sending to peer {self.rank} blocked for {self.timeout:.1f} s", self.rank) from e
        except OSError as e:
            raise PeerClosed(f"send to peer {self.rank} failed: {e}", self.rank) from e

    def _fail(self, error: BaseException) -> None:
        """Record a send failure: queued frames are dropped and waiters wake to re-raise it."""
        with self._cond:
            self._error = error
            self._queue.clear()
            self._cond.notify_all()

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
            except BaseException as e:  # noqa: BLE001 - the sender thread's failure, raised by the op waiting on it
                self._fail(e)
                return
            header, payload = b"", None  # drop the sent buffer: an idle thread must not keep the caller's array alive
            with self._cond:
                self._done = ticket
                self._cond.notify_all()

    def wait_sent(self, ticket: int, deadline: float) -> None:
        """Block until frame `ticket` (and all before it) left this process's buffers."""
        if self._done >= ticket:
            return
        with self._cond:
            while self._done < ticket:
                if self._error is not None:
                    raise self._failure() from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(f"send to peer {self.rank} did not complete", self.rank)
                if not self._cond.wait(min(left, RECV_WAKEUP)) and self.idle is not None and self._done < ticket:
                    self.idle()

    def _failure(self) -> PeerError:
        """The stored send failure as a fresh exception of the same kind (timeout or closed link)."""
        kind = PeerTimeout if isinstance(self._error, PeerTimeout) else PeerClosed
        return kind(str(self._error), self.rank)

    def sent_through(self, ticket: int) -> bool:
        """Whether frame `ticket` left this process (or failed); never blocks."""
        return self._done >= ticket or self._error is not None

    def flush(self, deadline: float) -> None:
        """Block until every queued frame was sent."""
        self.wait_sent(self._posted, deadline)

    def acquire_writer(self, deadline: float) -> None:
        """Take `write_lock` with no frame queued or half-written: flush, take it, and flush again if a send was
        posted meanwhile (another thread may post, see `send`). The caller releases `write_lock`."""
        while True:
            self.flush(deadline)
            self._lock.acquire()
            if self._done >= self._posted:
                return
            self._lock.release()

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

    def send_some(self, buffers: list[memoryview]) -> int:
        """Write what the socket takes of `buffers` right now (the caller holds `write_lock`); the bytes written."""
        try:
            return self.sock.sendmsg(buffers, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise PeerClosed(f"send to peer {self.rank} failed: {e}", self.rank) from e

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

    def shutdown(self) -> None:
        """Shut the socket down both ways, from any thread: a receive or send blocked on it returns at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
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


def wait_readable(peers: list[Peer], timeout: float) -> list[Peer]:
    """The `peers` with something to read within `timeout` seconds (all of them idle: an empty list)."""
    if not peers:
        return []
    ready, _, _ = select.select(peers, [], [], timeout)
    return ready
