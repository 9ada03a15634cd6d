"""The client side of `KvStream`: one stream per store, shared by every thread calling that store.

Callers hand a request to `KvStreamClient.call`, which gives it an id, queues it and waits (bounded by
its own deadline) for the answer with that id. gRPC's sender thread drains the queue, batching what is
queued into one message; a reader thread hands each answer to its caller. At most `max_in_flight`
requests are outstanding (callers past that wait for a slot within their deadline). A stream that ends
(coordinator restarted, connection lost, a follower replica turned it away) fails its outstanding
requests with UNAVAILABLE (`stream_ended`): the store sends those that are safe to repeat again as unary
calls (which retry and fail over between replicas), and the next request opens a new stream. A coordinator without the stream (UNIMPLEMENTED) sets `unsupported`, and
the store then uses the unary calls. A stream left idle is closed after `IDLE_CLOSE_S`.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import random
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import grpc

from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

CODES = {code.value[0]: code for code in grpc.StatusCode}
MAX_OPS_PER_MESSAGE = 512
"""Requests batched into one stream message at most."""
IDLE_CLOSE_S = 5.0
"""A stream with nothing outstanding and nothing sent for this long is closed (it would hold one of the
coordinator's `max_concurrent_calls` for as long as the process lives); the next request opens another."""


class KvStatus(grpc.RpcError):
    """A request's status from the stream (or the stream's own), shaped like the unary call's RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str, stream_ended: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.stream_ended = stream_ended
        """The stream itself ended (or was refused) before the request was answered."""

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_OPEN: weakref.WeakSet[_Stream] = weakref.WeakSet()
"""Streams not closed yet: closed at exit, so that no gRPC call is in flight while the interpreter ends. Closing one
waits (bounded) for both threads that use its call, the reader and gRPC's sender: at exit the interpreter stops
daemon threads wherever they are, and one stopped while it holds the call's lock hangs the call's `__del__`, run
later in that exit (the process never ends)."""


@atexit.register
def _close_open_streams() -> None:
    for stream in list(_OPEN):
        stream.close()


class _Stream:
    """One open KvStream call: its queue of requests, its outstanding answers and its reader thread."""

    def __init__(self, client: CoordinatorClient, name: str) -> None:
        self.requests: queue.SimpleQueue[pb.KvOp | None] = queue.SimpleQueue()
        self.pending: dict[int, Future[pb.KvResult]] = {}
        self.lock = threading.Lock()
        self.ended: KvStatus | None = None
        self.answered = False
        self.sender: threading.Thread | None = None
        """gRPC's thread that sends the requests (it runs `_messages`), once it started."""
        self.call: Any = client.stub.KvStream(self._messages())
        self.reader = threading.Thread(target=self._read, name=f"axond-kv-stream-{name}", daemon=True)
        _OPEN.add(self)  # before the reader starts: a start that stalls (the interpreter ending) is closed at exit too
        self.reader.start()

    def _messages(self) -> Iterator[pb.KvStreamRequest]:
        self.sender = threading.current_thread()
        last = time.monotonic()
        while True:
            try:
                op = self.requests.get(timeout=1.0)
            except queue.Empty:
                if self.ended is not None:
                    return
                with self.lock:
                    if not self.pending and self.requests.empty() and time.monotonic() - last > IDLE_CLOSE_S:
                        self.ended = KvStatus(grpc.StatusCode.UNAVAILABLE, "the KV stream was closed when idle")
                        return
                continue
            last = time.monotonic()
            if op is None:
                return
            ops = [op]
            while len(ops) < MAX_OPS_PER_MESSAGE:
                try:
                    nxt = self.requests.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    yield pb.KvStreamRequest(ops=ops)
                    return
                ops.append(nxt)
            yield pb.KvStreamRequest(ops=ops)

    def _read(self) -> None:
        ended = KvStatus(grpc.StatusCode.UNAVAILABLE, "the KV stream ended before this request was answered", True)
        try:
            for message in self.call:
                self.answered = True
                for result in message.results:
                    with self.lock:
                        fut = self.pending.pop(result.id, None)
                    if fut is not None:
                        fut.set_result(result)
        except grpc.RpcError as e:
            ended = KvStatus(e.code(), e.details() or "", True)
        except ValueError as e:  # the client's channel was closed
            ended = KvStatus(grpc.StatusCode.CANCELLED, f"the KV stream's channel was closed ({e})", True)
        with self.lock:
            self.ended = self.ended or ended
            waiting, self.pending = self.pending, {}
        self.requests.put(None)  # the sender ends now, not at its next poll: an ended stream leaves no thread behind
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(ended)

    def send(self, op: pb.KvOp) -> Future[pb.KvResult] | None:
        """The future of `op`'s answer; None if this stream has ended (open another)."""
        fut: Future[pb.KvResult] = Future()
        with self.lock:
            if self.ended is not None:
                return None
            self.pending[op.id] = fut
        self.requests.put(op)
        return fut

    def forget(self, op_id: int) -> None:
        with self.lock:
            self.pending.pop(op_id, None)

    def close(self, wait: float = 1.0) -> None:
        """Cancel the call and wait (at most `wait` seconds in all) for its reader and its sender to end."""
        _OPEN.discard(self)
        self.requests.put(None)
        self.call.cancel()
        join_threads((self.reader, self.sender), wait)


def join_threads(threads: Iterable[threading.Thread | None], wait: float) -> None:
    """Join each of `threads` (None, the calling thread or one never started: skipped) within `wait` seconds in all."""
    deadline = time.monotonic() + wait
    for thread in threads:
        if thread is not None and thread is not threading.current_thread() and thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


class KvStreamClient:
    """A KvStream shared by the callers of one store (thread-safe)."""

    def __init__(self, client: CoordinatorClient, name: str, max_in_flight: int = 1_000) -> None:
        self._client = client
        self._name = name
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stream: _Stream | None = None
        self.unsupported = False
        """The coordinator does not serve KvStream (an older axond): use the unary calls."""

    def _current(self) -> _Stream:
        with self._lock:
            if self._stream is None or self._stream.ended is not None:
                self._stream = _Stream(self._client, self._name)
            return self._stream

    def call(self, kind: str, request: Any, deadline: float) -> Any:
        """The reply of `request` (a unary KV request message, `kind` its KvOp field) by `deadline`
        (time.monotonic()); raises KvStatus with the status the unary call would have had."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise KvStatus(grpc.StatusCode.DEADLINE_EXCEEDED, f"no room on the KV stream before the deadline ({kind})")
        try:
            attempt = 0
            while True:
                try:
                    return self._once(kind, request, deadline)
                except KvStatus as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                        self.unsupported = True
                        raise
                    pause = self._pause(e, attempt)
                    if pause is None or time.monotonic() + pause >= deadline:
                        raise
                    time.sleep(pause)
                    attempt += 1
        finally:
            self._slots.release()

    @staticmethod
    def _pause(e: KvStatus, attempt: int) -> float | None:
        """How long to sleep before sending again (None: do not)."""
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in e.details():
            return random.uniform(0, min(1.6, 0.05 * 2 ** min(attempt, 16)))  # the stream was refused, nothing ran
        return None

    def _once(self, kind: str, request: Any, deadline: float) -> Any:
        op = pb.KvOp(id=next(self._ids))
        getattr(op, kind).CopyFrom(request)
        while True:
            stream = self._current()
            fut = stream.send(op)
            if fut is not None:
                break
        try:
            result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            stream.forget(op.id)
            raise KvStatus(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to the {kind} request on the KV stream "
                           "before its deadline") from None
        if result.code:
            raise KvStatus(CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message)
        return getattr(result, kind)

    def close(self) -> None:
        """End the stream (outstanding requests fail)."""
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
