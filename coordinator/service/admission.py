"""Fair admission: no one client's calls, streams or request bytes can take the coordinator from everyone else.

Every call and stream is counted while it runs, in one of two pools, per client connection (`context.peer()`) and
per client address (the peer's IP address: opening more connections from one host does not buy more). The liveness
pool (status, heartbeats, new nodes and the reports a node makes when its ranks end) is reserved: whatever floods the
rest, those always find room, so `axond status`, new nodes and every node's lease keep answering. The standard
health check is not counted at all: it holds nothing (answered at once), and it is all an unauthenticated caller
gets (auth.py). Bytes of decoded requests held by running calls are counted too, overall and per address, and those
of a KvStream message until its last waiting request is answered (`StreamBytes`, kv_stream.py): past
`max_request_bytes` a unary request is refused before it is decoded. Past any cap a call is refused at once with
RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded"), which clients send again with jittered backoff: a refused
call did not run. A refusal sets the call's status and returns (status_codes.refuse): it keeps nothing.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
import grpc.aio

from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.service.auth import replace_handler
from axond.coordinator.service.status_codes import refuse

UNCOUNTED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
"""Calls that hold nothing (answered at once): never counted, never refused for capacity."""
LIVENESS_METHODS = frozenset({
    "/grpc.health.v1.Health/Watch",
    "/axond.v1.Coordinator/GetStatus", "/axond.v1.Coordinator/Heartbeat", "/axond.v1.Coordinator/HeartbeatStream",
    "/axond.v1.Coordinator/ReportExit", "/axond.v1.Coordinator/ReportFailure",
    "/axond.v1.Coordinator/DeregisterNode", "/axond.v1.Coordinator/RegisterNode",
})
"""Calls served from the reserved pool."""
BUSY = "Concurrent RPC limit exceeded"
"""What every refusal says (the clients' cue to back off and send the call again)."""

_REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("axond_request_bytes", default=0)
"""Size of the request the call's deserializer just read (gRPC runs it in the call's own task, just before the
handler, with no wait between them)."""


_STREAM: contextvars.ContextVar[StreamBytes | None] = contextvars.ContextVar("axond_stream_bytes", default=None)
"""The request bytes of the running request-streaming call (set by its admission wrapper, read by its handler)."""


class StreamBytes:
    """Request bytes a request-streaming call holds after reading them (a KvStream message whose requests wait),
    counted against its address's share and the overall budget like a unary call's request."""

    def __init__(self, admission: Admission, address: str) -> None:
        self.admission, self.address = admission, address
        self.held = 0
        self.closed = False

    def take(self, size: int) -> str | None:
        """Count `size` more bytes held; returns why they may not be instead (nothing counted)."""
        admission, limits = self.admission, self.admission.limits
        if self.closed:
            return "the stream has ended"
        here = admission._addresses[self.address]  # the stream itself is counted in, so its address is there
        if here[2] + size > limits.max_request_bytes_per_address:
            return (f"{BUSY}: the calls from {self.address} already hold {here[2]:,} request bytes; this message of "
                    f"{size:,} would pass their share (max_request_bytes_per_address); retry later")
        if admission.request_bytes + size > limits.max_request_bytes:
            return (f"{BUSY}: running calls hold {admission.request_bytes:,} request bytes; this message of {size:,} "
                    "would pass the coordinator's limit (max_request_bytes); retry later")
        here[2] += size
        admission.request_bytes += size
        self.held += size
        return None

    def give(self, size: int) -> None:
        """Count `size` bytes taken before out again (nothing once the call ended: `close` gave them all)."""
        if self.closed:
            return
        self.admission._addresses[self.address][2] -= size
        self.admission.request_bytes -= size
        self.held -= size

    def close(self) -> None:
        """The call ends: give back every byte it still holds (its waiting requests' tasks end after it)."""
        if self.held:
            self.give(self.held)
        self.closed = True


def stream_bytes() -> StreamBytes | None:
    """The running request-streaming call's `StreamBytes` (None outside one, or without admission)."""
    return _STREAM.get()


class TooBusy:
    """A request not decoded because decoded requests already held `max_request_bytes`."""

    def __init__(self, size: int, held: int) -> None:
        self.size, self.held = size, held


def address_of(peer: str) -> str:
    """The client address of a gRPC peer string: `ipv4:10.0.0.5:41234` -> `ipv4:10.0.0.5` (unix sockets: as is)."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


class Admission:
    """Counts of the calls running and the request bytes they hold, per pool, connection and address (touched only
    on the server's event loop)."""

    def __init__(self, limits: CoordinatorLimits) -> None:
        self.limits = limits
        self.running = [0, 0]
        """Calls running in the general pool [0] and the reserved liveness pool [1]."""
        self.request_bytes = 0
        """Bytes of the decoded requests that running calls hold."""
        self.refused = 0
        """Calls refused so far."""
        self._connections: dict[str, list[int]] = {}
        """By peer: [general calls, liveness calls]."""
        self._addresses: dict[str, list[int]] = {}
        """By address: [general calls, liveness calls, request bytes]."""

    def enter(self, peer: str, liveness: bool, size: int = 0) -> str | None:
        """Count a call (and its request's `size` bytes) in; returns why it is refused instead (nothing counted)."""
        pool = int(liveness)
        limits = self.limits
        if liveness:
            cap, per_connection, per_address = (limits.max_liveness_calls, limits.max_liveness_calls_per_client,
                                                 limits.max_liveness_calls_per_address)
        else:
            cap, per_connection, per_address = (limits.max_concurrent_calls, limits.max_calls_per_client,
                                                limits.max_calls_per_address)
        address = address_of(peer)
        mine = self._connections.get(peer)
        here = self._addresses.get(address)
        why = None
        if mine is not None and mine[pool] >= per_connection:
            limit = "max_liveness_calls_per_client" if liveness else "max_calls_per_client"
            why = (f"{BUSY}: this client connection already holds {mine[pool]} calls and streams, its share "
                   f"({limit}); finish or close some first")
        elif here is not None and here[pool] >= per_address:
            limit = "max_liveness_calls_per_address" if liveness else "max_calls_per_address"
            why = (f"{BUSY}: the clients at {address} already hold {here[pool]} calls and streams, their share "
                   f"({limit}); finish or close some first")
        elif self.running[pool] >= cap:
            limit = "max_liveness_calls" if liveness else "max_concurrent_calls"
            why = f"{BUSY}: the coordinator serves {self.running[pool]} calls at once, its limit ({limit}); retry later"
        elif size and here is not None and here[2] + size > limits.max_request_bytes_per_address:
            why = (f"{BUSY}: the calls from {address} already hold {here[2]:,} request bytes; this request of "
                   f"{size:,} would pass their share (max_request_bytes_per_address); retry later")
        if why is not None:
            self.refused += 1
            return why
        if mine is None:
            mine = self._connections[peer] = [0, 0]
        if here is None:
            here = self._addresses[address] = [0, 0, 0]
        mine[pool] += 1
        here[pool] += 1
        here[2] += size
        self.running[pool] += 1
        self.request_bytes += size
        return None

    def leave(self, peer: str, liveness: bool, size: int = 0) -> None:
        pool = int(liveness)
        self.running[pool] -= 1
        self.request_bytes -= size
        mine = self._connections[peer]
        mine[pool] -= 1
        if mine == [0, 0]:
            del self._connections[peer]
        address = address_of(peer)
        here = self._addresses[address]
        here[pool] -= 1
        here[2] -= size
        if here == [0, 0, 0]:
            del self._addresses[address]

    def clients(self) -> int:
        """Client connections with calls running."""
        return len(self._connections)

    def addresses(self) -> int:
        """Client addresses with calls running."""
        return len(self._addresses)

    def measured(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """`parse` that notes the request's size for the handler, and decodes nothing once decoded requests hold
        `max_request_bytes` (the handler then refuses the call)."""
        def deserialize(raw: bytes) -> Any:
            size = len(raw)
            _REQUEST_BYTES.set(size)
            if self.request_bytes + size > self.limits.max_request_bytes:
                return TooBusy(size, self.request_bytes)
            return parse(raw)

        return deserialize


def _too_busy(request: TooBusy) -> str:
    return (f"{BUSY}: running calls hold {request.held:,} request bytes; this request of {request.size:,} would pass "
            "the coordinator's limit (max_request_bytes); retry later")


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method so that it runs only once `Admission` lets it in (see the module doc)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}
        """By method: (the handler, its wrapped version), built once, not per call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method in UNCOUNTED_METHODS:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        liveness = method in LIVENESS_METHODS
        inner = cast("Callable[..., Any]",
                     handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
        # A request message per call: its bytes count while the call runs (streams' messages are read one by one).
        parse = handler.request_deserializer
        deserializer = (self.admission.measured(parse) if parse is not None and not handler.request_streaming
                        else None)
        measured = deserializer is not None
        behavior: Callable[..., Any]
        if inspect.isasyncgenfunction(inner):
            behavior = self._streaming(inner, liveness, measured, handler.request_streaming)
        else:  # unary, and streams written with context.write
            behavior = self._unary(inner, liveness, measured)
        wrapped = replace_handler(handler, behavior=behavior, request_deserializer=deserializer)
        if len(self._wrapped) < 1_000:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _unary(self, inner: Callable[[Any, Any], Awaitable[Any]], liveness: bool, measured: bool
               ) -> Callable[..., Awaitable[Any]]:
        admission = self.admission

        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, TooBusy):
                admission.refused += 1
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _too_busy(request))
                return None
            peer = context.peer() or "?"
            size = _REQUEST_BYTES.get() if measured else 0
            refused = admission.enter(peer, liveness, size)
            if refused is not None:
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
                return None
            try:
                return await inner(request, context)
            finally:
                admission.leave(peer, liveness, size)

        return behavior

    def _streaming(self, inner: Callable[[Any, Any], AsyncIterator[Any]], liveness: bool, measured: bool,
                   request_streaming: bool) -> Callable[..., AsyncIterator[Any]]:
        admission = self.admission

        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if isinstance(request, TooBusy):
                admission.refused += 1
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, _too_busy(request))
                return
            peer = context.peer() or "?"
            size = _REQUEST_BYTES.get() if measured else 0
            refused = admission.enter(peer, liveness, size)
            if refused is not None:
                refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
                return
            held = StreamBytes(admission, address_of(peer)) if request_streaming else None
            if held is not None:
                _STREAM.set(held)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                if held is not None:
                    held.close()
                admission.leave(peer, liveness, size)

        return behavior
