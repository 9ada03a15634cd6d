"""The peers' check during a coordinator outage reads each request line within one deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from axond.worker.peers import PROBE_TIMEOUT_S, _read_line


def test_a_client_dripping_bytes_is_cut_off_at_the_line_deadline() -> None:
    """A line sent one byte per tenth of the deadline, for three deadlines, is refused, though each byte on its
    own arrives within the socket timeout."""
    server, client = socket.socketpair()
    stop = threading.Event()

    def drip() -> None:
        end = time.monotonic() + 3 * PROBE_TIMEOUT_S
        while time.monotonic() < end and not stop.is_set():
            client.sendall(b"x")
            time.sleep(PROBE_TIMEOUT_S / 10)
        client.sendall(b"\n")

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        with pytest.raises((ValueError, OSError)):
            _read_line(server)
    finally:
        stop.set()
        t.join(10)
        server.close()
        client.close()


def test_a_whole_line_is_read() -> None:
    server, client = socket.socketpair()
    with server, client:
        client.sendall(b'{"job": "j"}\n')
        assert _read_line(server) == b'{"job": "j"}\n'
