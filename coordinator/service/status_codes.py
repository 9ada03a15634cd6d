"""Domain errors -> gRPC status codes, shared by the unary calls and the streams."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio

from axond.coordinator.state.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    StateError,
    Unavailable,
)
from axond.coordinator.service.kv_calls import WaitExpired

STATUS_OF: dict[type[StateError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

MAX_DETAIL_CHARS = 2000
"""Longest status detail sent back (details travel in metadata, which has a 16 KiB limit)."""


class Undecodable:
    """A request body that did not parse (see `decoding_safely`); answered with INVALID_ARGUMENT."""

    def __init__(self, method: str, error: str) -> None:
        self.method, self.error = method, error


def refuse(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, text: str) -> None:
    """End the call with `code` once its handler returns, instead of `context.abort`: abort raises, and the raised
    error's traceback and gRPC's frames form a reference cycle that keeps the request (up to the message limit) until
    a full garbage collection; a handler that sets its status and returns leaves nothing behind."""
    context.set_code(code)
    context.set_details(text[:MAX_DETAIL_CHARS])


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a domain exception maps to (None: not a domain exception), detail cut to size."""
    if isinstance(e, StateError):
        code = STATUS_OF.get(type(e), grpc.StatusCode.FAILED_PRECONDITION)
    elif isinstance(e, WaitExpired):
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        return None
    text = str(e)
    if len(text) > MAX_DETAIL_CHARS:
        text = text[:MAX_DETAIL_CHARS] + "..."
    return code, text
