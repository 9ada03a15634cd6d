"""Socket options and host facts of the tcp transport: kernel timeouts and buffers, and whether this host's ranks
outnumber its cores."""

from __future__ import annotations

import os
import socket
import struct

RECV_WAKEUP = 0.25
"""A blocked receive wakes this often to check the op's deadline."""
BUFFER_LIMITS = ("/proc/sys/net/core/wmem_max", "/proc/sys/net/core/rmem_max")
"""The most a process may set SO_SNDBUF / SO_RCVBUF to (the kernel silently clamps larger requests)."""


def tune_socket(sock: socket.socket, timeout: float, buffer_bytes: int = 0) -> None:
    """Blocking socket with kernel-side timeouts and no Nagle delay; send and receive buffers of `buffer_bytes`
    each, or (0) sized by the kernel's autotuning."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(timeout, RECV_WAKEUP)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))


def host_ranks(socks: list[socket.socket], local_ranks: int = 0) -> int:
    """Ranks on this host: the peers reached through a local address (plus this one), or `local_ranks` if larger."""
    return max(1 + sum(1 for s in socks if same_host(s)), local_ranks)


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def buffer_limit() -> int:
    """The largest socket buffer this process may set, both ways (0 if the kernel does not say)."""
    limits = []
    for path in BUFFER_LIMITS:
        try:
            with open(path) as f:
                limits.append(int(f.read().split()[0]))
        except (OSError, ValueError, IndexError):
            return 0
    return min(limits)


def same_host(sock: socket.socket) -> bool:
    try:
        peer_host, local_host = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:
        return False
    return bool(peer_host == local_host or peer_host.startswith("127.") or peer_host == "::1")


def _timeval(seconds: float) -> bytes:
    seconds = max(min(seconds, 10**6), 0.001)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
