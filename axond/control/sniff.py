"""Telling a coordinator that serves TLS from a link that drops connections, for a plaintext client.

A plaintext gRPC client sees a TLS server close the connection ("Socket closed"), just as it sees a proxy
close connections while nothing listens behind it (a published container port during a start): the first
is a setting to fix at once, the second a wait. One TLS handshake attempt tells them apart.
"""

from __future__ import annotations

import socket
import ssl


def speaks_tls(address: str, timeout: float) -> bool:
    """Whether the server at `HOST:PORT` answers a TLS handshake (with a certificate or a TLS alert);
    False when it closes the connection, answers something else, or cannot be reached within `timeout`."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asks whether TLS answers; nothing is sent over it
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host.strip("[]") or None):
                return True
    except ssl.SSLError as e:
        return "ALERT" in (e.reason or "").upper()  # a TLS alert is TLS; WRONG_VERSION_NUMBER is not
    except (OSError, ValueError):
        return False
