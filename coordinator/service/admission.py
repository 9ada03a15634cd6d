"""Fair admission: no one client's calls or streams can take the coordinator from everyone else.

Every call and stream is counted while it runs, per client (one client connection: `context.peer()`, a
process's channel) and in one of two pools. The liveness pool (health checks, status, heartbeats and the
reports a node makes when its ranks end) is reserved: whatever floods the rest, those always find room,
so `axond health`, `axond status` and every node's lease keep answering. A client may hold at most
`max_calls_per_client` calls and streams of the general pool and `max_liveness_calls_per_client` of the
reserved one; past a cap (its own or the pool's) a call is refused at once with RESOURCE_EXHAUSTED
("Concurrent RPC limit exceeded"), which clients send again with jittered backoff: a refused call did not run.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
import grpc.aio

from axond.coordinator.service.auth import replace_handler
from axond.coordinator.limits import CoordinatorLimits

LIVENESS_METHODS = frozenset({
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
    "/axond.v1.Coordinator/GetStatus", "/axond.v1.Coordinator/Heartbeat", "/axond.v1.Coordinator/HeartbeatStream",
    "/axond.v1.Coordinator/ReportExit", "/axond.v1.Coordinator/ReportFailure",
    "/axond.v1.Coordinator/DeregisterNode",
})
"""Calls served from the reserved pool."""
BUSY = "Concurrent RPC limit exceeded"
"""What every refusal says (the clients' cue to back off and send the call again)."""


class Admission:
    """Counts of the calls running, per pool and per client (touched only on the server's event loop)."""

    def __init__(self, limits: CoordinatorLimits) -> None:
        self.limits = limits
        self.running = [0, 0]
        """Calls running in the general pool [0] and the reserved liveness pool [1]."""
        self.refused = 0
        """Calls refused so far."""
        self._clients: dict[str, list[int]] = {}

    def enter(self, client: str, liveness: bool) -> str | None:
        """Count a call in; returns why it is refused instead (nothing counted)."""
        pool = int(liveness)
        limits = self.limits
        cap, per_client = ((limits.max_liveness_calls, limits.max_liveness_calls_per_client) if liveness
                           else (limits.max_concurrent_calls, limits.max_calls_per_client))
        mine = self._clients.get(client)
        if mine is not None and mine[pool] >= per_client:
            self.refused += 1
            limit = "max_liveness_calls_per_client" if liveness else "max_calls_per_client"
            return (f"{BUSY}: this client already holds {mine[pool]} calls and streams, its share ({limit}); "
                    "finish or close some first")
        if self.running[pool] >= cap:
            self.refused += 1
            limit = "max_liveness_calls" if liveness else "max_concurrent_calls"
            return (f"{BUSY}: the coordinator serves {self.running[pool]} calls at once, its limit ({limit}); "
                    "retry later")
        if mine is None:
            mine = self._clients[client] = [0, 0]
        mine[pool] += 1
        self.running[pool] += 1
        return None

    def leave(self, client: str, liveness: bool) -> None:
        pool = int(liveness)
        self.running[pool] -= 1
        mine = self._clients[client]
        mine[pool] -= 1
        if mine == [0, 0]:
            del self._clients[client]

    def clients(self) -> int:
        """Clients with calls running."""
        return len(self._clients)


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
        if handler is None:
            return handler
        method: str = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        liveness = method in LIVENESS_METHODS
        inner = cast("Callable[..., Any]",
                     handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
        if inspect.isasyncgenfunction(inner):
            wrapped = replace_handler(handler, behavior=self._streaming(inner, liveness))
        else:  # unary, and streams written with context.write
            wrapped = replace_handler(handler, behavior=self._unary(inner, liveness))
        if len(self._wrapped) < 1_000:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _unary(self, inner: Callable[[Any, Any], Awaitable[Any]], liveness: bool) -> Callable[..., Awaitable[Any]]:
        admission = self.admission

        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            client = context.peer() or "?"
            refused = admission.enter(client, liveness)
            if refused is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            try:
                return await inner(request, context)
            finally:
                admission.leave(client, liveness)

        return behavior

    def _streaming(self, inner: Callable[[Any, Any], AsyncIterator[Any]], liveness: bool
                   ) -> Callable[..., AsyncIterator[Any]]:
        admission = self.admission

        async def behavior(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            client = context.peer() or "?"
            refused = admission.enter(client, liveness)
            if refused is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                admission.leave(client, liveness)

        return behavior
