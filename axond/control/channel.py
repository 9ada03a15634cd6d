"""Opening a gRPC channel to the coordinator: address parsing, TLS, the token on every call."""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import grpc

from axond.errors import CoordinatorError

DEFAULT_PORT = 29500

DEFAULT_CONNECT_TIMEOUT_S = 20.0
"""How long one connection attempt (TCP connect, TLS and HTTP/2 handshakes) may take when the caller gives
no connect timeout (gRPC's own default)."""

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect soon after a failed attempt (gRPC's default backoff grows to 120 s): a client waiting
    # for a coordinator that is starting sees it within ~1 s of it listening.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
"""Options of every channel to the coordinator, except the connect timeout (see channel_options)."""


def channel_options(connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> list[tuple[str, int]]:
    """CHANNEL_OPTIONS with the time one connection attempt may take.

    gRPC takes that time from `grpc.min_reconnect_backoff_ms` (an attempt's deadline is the larger of it
    and the current backoff), so it is set from the connect timeout, never from the reconnect backoff: a
    short value there fails every handshake slower than it (a link with 50 ms of latency each way).
    """
    if not connect_timeout > 0:
        raise CoordinatorError(f"connect timeout is {connect_timeout}; it must be > 0 seconds")
    return [*CHANNEL_OPTIONS, ("grpc.min_reconnect_backoff_ms", max(1, int(connect_timeout * 1000)))]


SCHEMES = ("grpc://", "http://")
"""Prefixes accepted (and dropped) before HOST:PORT; TLS is chosen by --tls-ca, not by the scheme."""

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9_.-]+)$")


def _not_host_port(given: str) -> CoordinatorError:
    return CoordinatorError(
        f"coordinator address {given!r} is not HOST:PORT (e.g. localhost:{DEFAULT_PORT}, 10.0.0.5:{DEFAULT_PORT} "
        f"or [::1]:{DEFAULT_PORT})"
    )


def split_addresses(address: str) -> list[str]:
    """The coordinator replicas' addresses in `H1:P1,H2:P2,...` (one address: a list of one), each normalized."""
    parts = [a for a in address.split(",") if a.strip()]
    if not parts:
        return [normalize_address(address)]
    return [normalize_address(a) for a in parts]


def normalize_address(address: str) -> str:
    """`HOST:PORT`, `[IPv6]:PORT`, `HOST` (port 29500), optionally as `grpc://...` or `http://...`; several
    of them (coordinator replicas) separated by commas.

    Anything else raises CoordinatorError saying which form to use (gRPC would only say
    "Misformatted domain name" much later).
    """
    if "," in address:
        return ",".join(split_addresses(address))
    given = address
    address = address.strip()
    lowered = address.lower()
    for prefix in ("grpcs://", "https://"):
        if lowered.startswith(prefix):
            raise CoordinatorError(
                f"coordinator address {given!r}: drop {address[:len(prefix)]!r} and pass HOST:PORT with "
                "--tls-ca CA.pem to use TLS"
            )
    for prefix in SCHEMES:
        if lowered.startswith(prefix):
            address = address[len(prefix):]
    address = address.rstrip("/")
    if not address:
        raise CoordinatorError("empty coordinator address: pass --coordinator HOST:PORT or set AXOND_COORDINATOR")
    if "/" in address or "@" in address:
        raise _not_host_port(given)
    if address.startswith("[") and address.endswith("]"):
        host, port = address, str(DEFAULT_PORT)
    elif address.count(":") > 1 and not address.startswith("["):
        raise CoordinatorError(
            f"coordinator address {given!r}: write an IPv6 address in brackets, e.g. [::1]:{DEFAULT_PORT}"
        )
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, str(DEFAULT_PORT)
    if not _HOST.match(host):
        raise _not_host_port(given)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise CoordinatorError(f"coordinator address {given!r} has no valid port (1..65535); use HOST:PORT")
    return f"{host}:{int(port)}"


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str | Callable[[], str | None]) -> None:
        self._token = token

    def _details(self, d: Any) -> _CallDetails:
        token = self._token if isinstance(self._token, str) else self._token()
        metadata = list(d.metadata or []) + ([("authorization", f"Bearer {token}")] if token else [])
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def read_file(path: str, what: str) -> bytes:
    """The bytes of `path` (a PEM file); CoordinatorError naming `what` if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CoordinatorError(f"cannot read the {what} file {path!r}: {e.strerror}") from e


def open_channel(
    address: str, token: str | Callable[[], str | None] | None, tls_ca: str | None, tls_cert: str | None = None,
    tls_key: str | None = None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> grpc.Channel:
    """A channel to `address`: TLS verified against `tls_ca` if given (with a client certificate for mutual
    TLS when `tls_cert`/`tls_key` are given), the token (or what a token source returns) on every call; one
    connection attempt (handshakes included) may take `connect_timeout` seconds."""
    options = channel_options(connect_timeout)
    if (tls_cert is None) != (tls_key is None):
        raise CoordinatorError("a client certificate needs both --tls-cert and --tls-key")
    if tls_cert and not tls_ca:
        raise CoordinatorError("a client certificate (--tls-cert) needs --tls-ca: mutual TLS runs over TLS")
    if tls_ca:
        ca = read_file(tls_ca, "TLS CA")
        cert = read_file(tls_cert, "TLS client certificate") if tls_cert else None
        key = read_file(tls_key, "TLS client key") if tls_key else None
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.secure_channel(address, creds, options)
    else:
        channel = grpc.insecure_channel(address, options)
    if token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel
