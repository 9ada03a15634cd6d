"""The client side of `HeartbeatStream`: one long-lived stream per node carrying its heartbeats.

`beat` sends one heartbeat and waits (bounded) for its answer; answers come in order, one per
request. A stream that fails or does not answer in time is dropped and the next beat opens a new one
(at once, within the same beat, if the dropped stream had been answering: the coordinator restarted).
A coordinator without the stream (UNIMPLEMENTED) sets `unsupported`: use the unary Heartbeat.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from axond.control.errors import translate
from axond.control.kv_stream import KvStatus, join_threads
from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient


_OPEN: weakref.WeakSet[_Call] = weakref.WeakSet()
"""Streams not closed yet: closed at exit, so that no gRPC call is in flight while the interpreter ends (see
`kv_stream._OPEN`: closing waits for the reader and gRPC's sender)."""


@atexit.register
def _close_open_streams() -> None:
    for call in list(_OPEN):
        call.close()


class _Call:
    """One open HeartbeatStream: requests in, answers (or the stream's end) out."""

    def __init__(self, client: CoordinatorClient, node_id: str) -> None:
        self.requests: queue.SimpleQueue[pb.HeartbeatRequest | None] = queue.SimpleQueue()
        self.answers: queue.SimpleQueue[pb.HeartbeatResponse | KvStatus] = queue.SimpleQueue()
        self.answered = False
        self.closed = False
        self.sender: threading.Thread | None = None
        """gRPC's thread that sends the requests (it runs `_messages`), once it started."""
        self.call: Any = client.stub.HeartbeatStream(self._messages())
        self.reader = threading.Thread(target=self._read, name=f"axond-heartbeat-stream-{node_id}", daemon=True)
        _OPEN.add(self)  # before the reader starts (see `kv_stream._Stream`)
        self.reader.start()

    def _messages(self) -> Iterator[pb.HeartbeatRequest]:
        self.sender = threading.current_thread()
        while True:
            try:
                request = self.requests.get(timeout=1.0)
            except queue.Empty:
                if self.closed:
                    return
                continue
            if request is None:
                return
            yield request

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.answers.put(answer)
            ended = KvStatus(grpc.StatusCode.UNAVAILABLE, "the coordinator ended the heartbeat stream")
        except grpc.RpcError as e:
            ended = KvStatus(e.code(), e.details() or "")
        except ValueError as e:  # the client's channel was closed
            ended = KvStatus(grpc.StatusCode.CANCELLED, f"the heartbeat stream's channel was closed ({e})")
        self.requests.put(None)  # the sender ends now, not at its next poll
        self.answers.put(ended)

    def close(self, wait: float = 1.0) -> None:
        """Cancel the call and wait (at most `wait` seconds in all) for its reader and its sender to end."""
        _OPEN.discard(self)
        self.closed = True
        self.requests.put(None)
        self.call.cancel()
        join_threads((self.reader, self.sender), wait)


class HeartbeatStream:
    """The heartbeat stream of one node (thread-safe: concurrent beats take turns)."""

    def __init__(self, client: CoordinatorClient, node_id: str) -> None:
        self._client = client
        self._node_id = node_id
        self._call: _Call | None = None
        self._lock = threading.Lock()
        self.unsupported = False
        """The coordinator does not serve HeartbeatStream (an older axond): use the unary Heartbeat."""

    def beat(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse:
        """The coordinator's answer to `request` within `timeout` seconds; CoordinatorError otherwise."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise translate("HeartbeatStream", self._client.address, KvStatus(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"another heartbeat held the stream for {timeout:g} s"))
        try:
            return self._beat(request, timeout, deadline)
        finally:
            self._lock.release()

    def _beat(self, request: pb.HeartbeatRequest, timeout: float, deadline: float) -> pb.HeartbeatResponse:
        while True:
            call = self._call or _Call(self._client, self._node_id)
            self._call = call
            call.requests.put(request)
            try:
                answer = call.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                answer = KvStatus(grpc.StatusCode.DEADLINE_EXCEEDED, f"no heartbeat answer within {timeout:g} s")
            if isinstance(answer, pb.HeartbeatResponse):
                call.answered = True
                return answer
            self.close()
            if answer.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
            stale = call.answered and answer.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            if not stale or deadline - time.monotonic() < 0.05:
                raise translate("HeartbeatStream", self._client.address, answer) from answer
            time.sleep(0.05)

    def close(self) -> None:
        """End the stream (the next beat opens another)."""
        call, self._call = self._call, None
        if call is not None:
            call.close()
