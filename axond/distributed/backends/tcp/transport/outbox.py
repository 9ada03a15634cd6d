"""The sending half of one peer's connection: framed, zero-copy sends, in order, each with a ticket.

Small frames are sent inline from the calling thread; mid-sized ones are first written without
blocking (whatever fits the socket buffer); the rest goes through a per-peer sender thread so that
sending, receiving and reducing overlap (socket calls release the GIL). `Peer` holds one and receives.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from axond.distributed.backends.tcp.policy import INLINE_SEND_BYTES
from axond.distributed.backends.tcp.transport.errors import PeerClosed, PeerError, PeerTimeout
from axond.distributed.backends.tcp.transport.sockets import RECV_WAKEUP
from axond.distributed.backends.tcp.transport.wire import HEADER_SIZE


class Outbox:
    """The frames posted to group rank `rank` over `sock`, and the lock every writer of the socket holds."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float, try_inline_bytes: int = 0) -> None:
        self.sock = sock
        self.rank = rank
        self.timeout = timeout
        self.try_inline_bytes = try_inline_bytes
        """Larger frames up to this size are first written without blocking from the calling thread."""
        self.write_lock = threading.Lock()
        """Held by whoever writes to the socket (the op thread's inline sends, the sender thread, a `Swap`)."""
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview | None, int]] = deque()
        self._posted = 0
        self._post_lock = threading.Lock()
        self._done = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.idle: Callable[[], None] | None = None
        """Run each time `wait_sent` wakes up without progress (every RECV_WAKEUP); may raise to end it."""

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
                with self.write_lock:
                    self._write(header, payload)
            except BaseException as e:
                self._fail(e)
                raise
            self._done = ticket
            return ticket
        if payload is not None and nbytes <= self.try_inline_bytes and self._done == self._posted:
            with self.write_lock:  # held until the rest is queued: no other writer starts a frame inside this one
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
        """Send what fits in the socket buffer right now (no thread hand-off; the caller holds `write_lock`); returns
        the bytes sent."""
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
                with self.write_lock:
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
            self.write_lock.acquire()
            if self._done >= self._posted:
                return
            self.write_lock.release()

    def send_some(self, buffers: list[memoryview]) -> int:
        """Write what the socket takes of `buffers` right now (the caller holds `write_lock`); the bytes written."""
        try:
            return self.sock.sendmsg(buffers, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise PeerClosed(f"send to peer {self.rank} failed: {e}", self.rank) from e

    def try_send_now(self, frame: bytes) -> None:
        """Best effort, never blocking for long: used to tell a peer that this rank aborts."""
        if self.write_lock.acquire(timeout=0.2):
            try:
                self.sock.send(frame, socket.MSG_DONTWAIT)
            except OSError:
                pass
            finally:
                self.write_lock.release()

    def stop(self) -> None:
        """Drop the queued frames and end the sender thread once the socket is closed (`join`)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def join(self) -> None:
        """Wait (up to 2 s) for the sender thread to end, unless this is it."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
