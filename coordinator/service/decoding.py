"""Request bodies that do not parse reach the servicer as `Undecodable`, answered INVALID_ARGUMENT.

Left to gRPC, a body that fails to parse (junk bytes, invalid UTF-8 in a string field) is answered
with INTERNAL/UNKNOWN; this interceptor wraps each Coordinator method's deserializer instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from axond.coordinator.service.auth import replace_handler
from axond.coordinator.service.status_codes import Undecodable

PREFIX = "/axond.v1.Coordinator/"


def _safe(method: str, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad body
            return Undecodable(method.rsplit("/", 1)[-1], f"{type(e).__name__}: {e}")

    return deserialize


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps the request deserializer of every Coordinator method (see the module doc)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(PREFIX) or handler.request_deserializer is None:
            return handler
        if not (handler.unary_unary or handler.unary_stream or handler.stream_stream):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]  # built once per method, not per call
        wrapped = replace_handler(handler, request_deserializer=_safe(method, handler.request_deserializer))
        if len(self._wrapped) < 1_000:
            self._wrapped[method] = (handler, wrapped)
        return wrapped
