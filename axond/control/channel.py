"""Opening a gRPC channel to the coordinator: address parsing, TLS, the token on every call."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import grpc

from axond.errors import CoordinatorError

DEFAULT_PORT = 29500

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def normalize_address(address: str) -> str:
    """`host:port` (the port defaults to 29500); `grpc://` prefixes are accepted."""
    address = address.strip()
    for prefix in ("grpc://", "grpcs://"):
        if address.startswith(prefix):
            address = address[len(prefix):]
    if not address:
        raise CoordinatorError("empty coordinator address: pass --coordinator HOST:PORT or set AXOND_COORDINATOR")
    host, sep, port = address.rpartition(":")
    if not sep or host.endswith(":") or (address.startswith("[") and address.endswith("]")):
        return f"{address}:{DEFAULT_PORT}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise CoordinatorError(f"coordinator address {address!r} has no valid port; use HOST:PORT")
    return address


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> _CallDetails:
        metadata = list(d.metadata or []) + [self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CoordinatorError(f"cannot read the {what} file {path!r}: {e.strerror}") from e


def open_channel(
    address: str, token: str | None, tls_ca: str | None, tls_cert: str | None = None, tls_key: str | None = None
) -> grpc.Channel:
    """A channel to `address`: TLS verified against `tls_ca` if given (with a client certificate for mutual
    TLS when `tls_cert`/`tls_key` are given), the token on every call."""
    if (tls_cert is None) != (tls_key is None):
        raise CoordinatorError("a client certificate needs both --tls-cert and --tls-key")
    if tls_cert and not tls_ca:
        raise CoordinatorError("a client certificate (--tls-cert) needs --tls-ca: mutual TLS runs over TLS")
    if tls_ca:
        ca = _read(tls_ca, "TLS CA")
        cert = _read(tls_cert, "TLS client certificate") if tls_cert else None
        key = _read(tls_key, "TLS client key") if tls_key else None
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.secure_channel(address, creds, CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, CHANNEL_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel
