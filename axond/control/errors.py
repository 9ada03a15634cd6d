"""Translate gRPC failures into axond errors that say what happened and what to do."""

from __future__ import annotations

import grpc

from axond.errors import AxondError, CoordinatorError, StoreError, StoreTimeout

ADVICE: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAVAILABLE: "is the coordinator running and reachable at that address (and TLS/plaintext matching)?",
    grpc.StatusCode.UNAUTHENTICATED: "pass the coordinator's token with --token, --token-file or AXOND_TOKEN",
    grpc.StatusCode.PERMISSION_DENIED: "node-scoped calls need the node's own secret from RegisterNode",
    grpc.StatusCode.OUT_OF_RANGE: "the value would leave its range",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the request's arguments",
    grpc.StatusCode.NOT_FOUND: "check the job/node names with `axond status`",
    grpc.StatusCode.FAILED_PRECONDITION: "the job or node is not in a state that allows this; see `axond status`",
    grpc.StatusCode.ALREADY_EXISTS: "pick another job name",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "a coordinator limit was reached (see its message); send less or clean up",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the call ran out of time; raise the timeout or check the other nodes",
    grpc.StatusCode.UNIMPLEMENTED: "the coordinator is an incompatible axond version",
}


NOT_GRPC = ("failed parsing http/2",)
"""Connect failures of a server that answered, but not in HTTP/2: the address is another service's port."""


class NotGrpcError(CoordinatorError):
    """The address answers, but not with gRPC: some other service's port, not the coordinator's."""


def not_grpc(e: grpc.RpcError) -> bool:
    """Whether `e` says the server at the address answered in something else than HTTP/2 (so not gRPC)."""
    details = (e.details() if hasattr(e, "details") else "") or ""
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(text in details.lower() for text in NOT_GRPC)


def describe(op: str, address: str, e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    detail = e.details() if hasattr(e, "details") else str(e)
    advice = ADVICE.get(code, "see the coordinator's log")
    return f"{op} at coordinator {address} failed: {code.name}: {detail} ({advice})"


def translate(op: str, address: str, e: grpc.RpcError, store: bool = False) -> AxondError:
    """The axond error for a failed call: CoordinatorError, or for store calls (`store=True`)
    StoreTimeout when the wait ran out and StoreError otherwise."""
    if not_grpc(e):
        message = (f"{address} answers, but not with gRPC: is it the coordinator's port? (`axond coordinator "
                   f"--port`, 29500 by default; a --metrics-port serves HTTP) [{e.details()}]")
        return StoreError(message) if store else NotGrpcError(message)
    message = describe(op, address, e)
    if not store:
        return CoordinatorError(message)
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StoreTimeout(message)
    return StoreError(message)
