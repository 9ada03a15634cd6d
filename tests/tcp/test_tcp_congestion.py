"""AXOND_TCP_CONGESTION: the tcp backend's sockets keep the kernel's congestion control (`system`) or take the one
named, and a name the kernel refuses says what it offers (docs/fault-tolerance.md#a-flapping-link says when to
choose one: tests/cluster/test_netns_flap.py runs with cubic)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.sockets import TCP_CONGESTION, set_congestion
from axond.distributed.process_group import ProcessGroup
from axond.testing import run_threads


def _kernel_default() -> str | None:
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return None


needs_linux = pytest.mark.skipif(_kernel_default() is None, reason="no /proc/sys/net/ipv4 (not Linux)")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@needs_linux
def test_system_keeps_the_kernels_default_and_a_name_is_set_or_refused_with_what_the_kernel_offers(pair) -> None:
    a, b = pair
    assert set_congestion(b, "system") == _kernel_default()
    assert set_congestion(a, "reno") == "reno"  # always built in, and always allowed
    with pytest.raises(ValueError, match=r"'nosuchcontrol': the kernel refused it .*it has .*reno.*or system"):
        set_congestion(a, "nosuchcontrol")
    assert set_congestion(a, "system") == "reno", "system leaves the socket as it is"


def test_congestion_is_read_from_the_environment_and_checked() -> None:
    assert TcpOptions().congestion == "system"
    for good in ("system", "cubic", "bbr", "reno"):
        assert TcpOptions.from_env({"AXOND_TCP_CONGESTION": good}).congestion == good
    for bad in ("BBR", "cubic;", "x" * 16, "no such", "Auto"):
        with pytest.raises(ValueError, match="AXOND_TCP_CONGESTION"):
            TcpOptions.from_env({"AXOND_TCP_CONGESTION": bad})
    with pytest.raises(ValueError, match="congestion="):
        TcpOptions(congestion="Cubic")


@needs_linux
def test_a_groups_sockets_take_the_groups_congestion_control() -> None:
    def controls(pg: ProcessGroup) -> list[str]:
        return [p.sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
                for p in pg.backend.g.peers.values()]  # type: ignore[union-attr]

    options = BackendOptions(timeout=10.0, tcp=TcpOptions(congestion="reno", shm=False))
    assert run_threads(controls, 3, timeout=30.0, options=options) == [["reno", "reno"]] * 3
    options = BackendOptions(timeout=10.0, tcp=TcpOptions(shm=False))
    assert run_threads(controls, 2, timeout=30.0, options=options) == [[_kernel_default()]] * 2
