"""The peers' check during a coordinator outage reads each request line within one deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from axond.control.client import CoordinatorClient

from axond.worker.peers import PROBE_TIMEOUT_S, PeerLink, _read_line


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


def test_a_peer_says_since_when_its_contact_is_back_and_a_closed_one_does_not_answer(client: CoordinatorClient) -> None:
    """Two nodes' links of one generation over real sockets: the probe carries the peer's silence, lease and how long
    its contact has been back (inf: never lost), authenticated; once the peer closed its link (it moved on), the
    probe gets no answer, which the outage guard reads as "stop"."""
    secret = b"s" * 16
    env = {"AXOND_SOCKET_IFNAME": "lo"}
    contact = [float("inf")]
    a = PeerLink(client, "j", 3, 0, 1, secret, lambda: 1.25, lambda: 2.0, contact_for=lambda: contact[0], env=env)
    b = PeerLink(client, "j", 3, 1, 1, secret, lambda: 0.0, lambda: 2.0, env=env)
    try:
        b.peers[0] = a.address
        (view,) = b.probe()
        assert view is not None and (view.generation, view.silent_for, view.lease) == (3, 1.25, 2.0)
        assert view.contact_for == float("inf") and view.lost_coordinator
        contact[0] = 0.5
        (view,) = b.probe()
        assert view is not None and view.contact_for == 0.5
        other = PeerLink(client, "j", 3, 2, 1, b"t" * 16, lambda: 0.0, lambda: 2.0, env=env)  # another secret
        other.peers[0] = a.address
        assert other.probe() == [None]
        other.close()
        a.close()
        (view,) = b.probe()
        assert view is None
    finally:
        a.close()
        b.close()


def test_unreachable_names_only_the_peers_that_answer_no_connection_at_all(client: CoordinatorClient) -> None:
    """A live peer's link and a closed port (refused: its host answers) are reachable; a listener whose accept queue
    is full drops every handshake, as a cut link does, and is named after the tries."""
    env = {"AXOND_SOCKET_IFNAME": "lo"}
    me = PeerLink(client, "j", 3, 0, 1, b"s" * 16, lambda: 0.0, lambda: 2.0, env=env)
    live = PeerLink(client, "j", 3, 1, 1, b"s" * 16, lambda: 0.0, lambda: 2.0, env=env)
    closed = socket.create_server(("127.0.0.1", 0))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    held = socket.create_connection(silent.getsockname(), timeout=PROBE_TIMEOUT_S)  # fills the queue of one
    try:
        me.peers.update({1: live.address, 2: closed.getsockname(), 3: silent.getsockname()})
        closed.close()
        assert me.unreachable() == [3]
        assert me.unreachable(tries=1) == [3]
    finally:
        held.close()
        silent.close()
        me.close()
        live.close()
