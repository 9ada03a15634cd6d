"""The shared-token check: every call but the standard health check needs `authorization: Bearer <token>`.

The health check (`Health/Check`, one answer) is exempt so that probes (compose, Kubernetes' grpc probe) work
without the token; it reveals nothing but SERVING, and a request body past `MAX_CHECK_BYTES` is refused before it is
decoded. Everything else (`Health/Watch`, reflection, every Coordinator RPC) is refused with UNAUTHENTICATED when the
token is missing or wrong, checked on the call's metadata before its body is read: the refusal is served as a
request-streaming handler that never asks for the message, so nothing an unauthenticated caller sends is decoded,
kept in Python or counted against any pool (gRPC frees the body with the call).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import grpc.aio

from axond.coordinator.service.status_codes import refuse

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
MAX_CHECK_BYTES = 1 << 10
"""Longest health-check request served (it names one service); a longer one is refused undecoded."""


def _metadata_value(metadata: Any, key: str) -> str | bytes | None:
    for item in metadata or ():
        k, v = item[0], item[1]
        if k == key:
            return v  # type: ignore[no-any-return]
    return None


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the token must be a non-empty string")
        self._expected = f"Bearer {token}".encode()
        self._check: tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]] | None = None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None:
            return handler
        if method == HEALTH_CHECK:
            return self._bounded_check(handler)
        got = _metadata_value(handler_call_details.invocation_metadata, "authorization")
        raw = got.encode() if isinstance(got, str) else (got or b"")
        if hmac.compare_digest(raw, self._expected):
            return handler
        why = "missing" if got is None else "wrong"
        return _deny(handler, f"{why} token: pass --token (or set AXOND_TOKEN) to the coordinator's token")


    def _bounded_check(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        cached = self._check
        if cached is not None and cached[0] is handler:
            return cached[1]
        parse, answer = handler.request_deserializer, cast("Callable[..., Awaitable[Any]]", handler.unary_unary)

        def deserialize(raw: bytes) -> Any:
            return _TOO_LONG if len(raw) > MAX_CHECK_BYTES else (parse(raw) if parse is not None else raw)

        async def check(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if request is _TOO_LONG:
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                       f"a health check request is at most {MAX_CHECK_BYTES} bytes")
                return None
            return await answer(request, context)

        wrapped = replace_handler(handler, behavior=check, request_deserializer=deserialize)
        self._check = (handler, wrapped)
        return wrapped


_TOO_LONG = object()


def _deny(handler: grpc.RpcMethodHandler[Any, Any], message: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details(message)

    return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=lambda _: b"")


def replace_handler(
    handler: grpc.RpcMethodHandler[Any, Any], behavior: Callable[..., Any] | None = None,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` of the same kind with another behavior and/or request deserializer (for interceptors)."""
    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    )
    current, make = next((k for k in kinds if k[0] is not None), kinds[-1])
    return make(
        cast("grpc._Behaviour", behavior or current),
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
