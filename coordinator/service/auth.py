"""The shared-token check: every call but the standard health check needs `authorization: Bearer <token>`.

The health service is exempt so that probes (compose, Kubernetes' grpc probe) work without the
token; it reveals nothing but SERVING. Reflection and every Coordinator RPC are refused with
UNAUTHENTICATED when the token is missing or wrong.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import grpc.aio

HEALTH_PREFIX = "/grpc.health.v1.Health/"


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

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        got = _metadata_value(handler_call_details.invocation_metadata, "authorization")
        raw = got.encode() if isinstance(got, str) else (got or b"")
        if hmac.compare_digest(raw, self._expected):
            return handler
        why = "missing" if got is None else "wrong"
        return _deny(handler, f"{why} token: pass --token (or set AXOND_TOKEN) to the coordinator's token")


def _deny(handler: grpc.RpcMethodHandler[Any, Any], message: str) -> grpc.RpcMethodHandler[Any, Any]:
    async def abort(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return replace_handler(handler, behavior=abort)


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
