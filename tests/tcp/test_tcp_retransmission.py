"""The tcp backend's sockets retransmit at most AXOND_TCP_RTO_MAX_MS apart (TCP_RTO_MAX_MS, Linux 6.15+), for as
long as the group's timeout (TCP_USER_TIMEOUT)."""

from __future__ import annotations

import socket

import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.peer import Peer
from axond.distributed.backends.tcp.transport.sockets import (
    RTO_MAX_MS, TCP_RTO_MAX_MS, USER_TIMEOUT_MARGIN_S, bound_rto,
)
from axond.distributed.process_group import ProcessGroup
from axond.testing import run_threads


def _kernel_caps_rto() -> bool:
    with socket.socket() as s:
        return bound_rto(s, RTO_MAX_MS)


needs_cap = pytest.mark.skipif(not _kernel_caps_rto(), reason="this kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")


@needs_cap
@pytest.mark.parametrize("rto_max_ms", [RTO_MAX_MS, 2500])
def test_a_peer_socket_retransmits_at_most_rto_max_ms_apart(rto_max_ms: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    try:
        Peer(a, 1, 5.0, 0.0, rto_max_ms=rto_max_ms)
        assert a.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS) == rto_max_ms
        # the kernel would give up after 15 capped retransmissions (about 15 s): it waits out the group's timeout
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == (5.0 + USER_TIMEOUT_MARGIN_S) * 1000
    finally:
        a.close()
        b.close()


def test_rto_max_ms_is_read_from_the_environment_and_checked() -> None:
    assert TcpOptions().rto_max_ms == RTO_MAX_MS
    assert TcpOptions.from_env({"AXOND_TCP_RTO_MAX_MS": "0"}).rto_max_ms == 0, "0: the kernel's own backoff"
    assert TcpOptions.from_env({"AXOND_TCP_RTO_MAX_MS": "5000"}).rto_max_ms == 5000
    for bad in ("500", "200000", "-1", "soon"):
        with pytest.raises(ValueError, match="AXOND_TCP_RTO_MAX_MS"):
            TcpOptions.from_env({"AXOND_TCP_RTO_MAX_MS": bad})


@needs_cap
def test_a_groups_sockets_take_the_groups_rto_max_ms() -> None:
    options = BackendOptions(timeout=10.0, tcp=TcpOptions(rto_max_ms=3000, shm=False))

    def caps(pg: ProcessGroup) -> list[int]:
        return [p.sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS)
                for p in pg.backend.g.peers.values()]  # type: ignore[union-attr]

    assert run_threads(caps, 3, timeout=30.0, options=options) == [[3000, 3000]] * 3
