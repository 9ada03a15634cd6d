"""Socket options and host facts of the tcp transport: kernel timeouts and buffers, and whether this host's ranks
outnumber its cores."""

from __future__ import annotations

import os
import re
import socket
import struct

RECV_WAKEUP = 0.25
"""A blocked receive wakes this often to check the op's deadline."""
RTO_MAX_MS = 1000
"""Default most milliseconds between two retransmissions of a socket (TCP_RTO_MAX_MS; the kernel's own is 120 s)."""
RTO_MAX_RANGE = (1000, 120_000)
"""What Linux accepts for TCP_RTO_MAX_MS, in milliseconds."""
TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)
"""The socket option (Linux 6.15+; <linux/tcp.h>): a per-socket cap on the retransmission timeout's backoff."""
USER_TIMEOUT_MARGIN_S = 5.0
"""Seconds a capped socket keeps retransmitting beyond the group's timeout, so that the op's own deadline, whose
error names op, group and peer, comes first."""
MAX_USER_TIMEOUT_S = 2_000_000.0
"""The most TCP_USER_TIMEOUT a socket gets (the option is a 32-bit count of milliseconds)."""
CONGESTION = "system"
"""Default congestion control of the sockets: "system" (the kernel's default) or a name the kernel knows (cubic,
reno, bbr...); see `set_congestion` for the trade-off."""
CONGESTION_NAME = re.compile(r"[a-z0-9_]{1,15}")
"""A congestion control's name as Linux spells them (TCP_CA_NAME_MAX is 16 with the terminating zero)."""
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)
CONGESTION_LISTS = ("/proc/sys/net/ipv4/tcp_available_congestion_control",
                    "/proc/sys/net/ipv4/tcp_allowed_congestion_control")
"""What the kernel has, and what a process without CAP_NET_ADMIN may choose."""
TCP_INFO_BYTES = 28
"""The head of Linux's struct tcp_info that `retransmitting` reads: 8 one-byte fields, then rto, ato, snd_mss, rcv_mss
and unacked (32 bits each)."""
BUFFER_LIMITS = ("/proc/sys/net/core/wmem_max", "/proc/sys/net/core/rmem_max")
"""The most a process may set SO_SNDBUF / SO_RCVBUF to (the kernel silently clamps larger requests)."""


def tune_socket(sock: socket.socket, timeout: float, buffer_bytes: int = 0, rto_max_ms: int = RTO_MAX_MS,
                congestion: str = CONGESTION) -> None:
    """Blocking socket with kernel-side timeouts and no Nagle delay; send and receive buffers of `buffer_bytes`
    each, or (0) sized by the kernel's autotuning; retransmissions at most `rto_max_ms` apart (`bound_rto`); the
    congestion control `congestion` (`set_congestion`)."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(timeout, RECV_WAKEUP)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
    bound_rto(sock, rto_max_ms, timeout)
    set_congestion(sock, congestion)


def set_congestion(sock: socket.socket, name: str = CONGESTION) -> str | None:
    """Set the congestion control of `sock` to `name`; what the socket uses afterwards (None: not a TCP socket or the
    kernel does not say). "system" keeps the kernel's default; a name the kernel refuses raises ValueError saying
    what it offers.

    The trade-off, measured between two namespace hosts (docs/fault-tolerance.md#a-flapping-link): BBR (this
    project's machines' default) paces each socket at the bandwidth it measured over its last round trips, and a
    lossy spell (a flapping link, a switch that drops for seconds) can leave that estimate at a few kbit/s with the
    round trip inflated by retransmissions, so once the link is steady the queued bytes may trickle out for seconds
    (seen: 220 KB queued, pacing at 11 kbit/s, 24 s after the link was steady; 1 of 6 runs stalled 7.8 s). Cubic
    and reno restart from one segment and grow back within about a second, but took twice BBR's time for 32-128 KiB
    all_reduce over the same link.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    if name != "system":
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, name.encode())
        except OSError as e:
            available, allowed = (_read_list(path) for path in CONGESTION_LISTS)
            raise ValueError(f"congestion control {name!r}: the kernel refused it ({e.strerror}); it has "
                             f"{available or 'unknown'}, and a process without CAP_NET_ADMIN may set "
                             f"{allowed or 'unknown'}: use one of those, or system") from None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
    except OSError:
        return None


def _read_list(path: str) -> str:
    try:
        with open(path) as f:
            return ", ".join(f.read().split())
    except OSError:
        return ""


def bound_rto(sock: socket.socket, rto_max_ms: int, give_up_s: float = 0.0) -> bool:
    """Cap the retransmission timeout of `sock` at `rto_max_ms` (0: leave the kernel's), retransmitting for
    `give_up_s` (the group's timeout) before the kernel gives up on the connection; whether the kernel took the cap.

    While a link drops packets, TCP doubles the wait before each retransmission up to the kernel's RTO_MAX (120 s),
    so after a flapping link is steady again the next retransmission (and with it all traffic) can be tens of
    seconds away. With the cap it is at most `rto_max_ms` away. But the kernel gives up after tcp_retries2 (15)
    retransmissions, about 15 s at a 1 s cap (924 s uncapped), so the cap comes with TCP_USER_TIMEOUT: data may stay
    unacknowledged as long as an op may wait, the group's timeout (which ends the op with a clear error first).
    Kernels before Linux 6.15 lack TCP_RTO_MAX_MS: the socket keeps the kernel's backoff and give-up time.
    """
    if rto_max_ms <= 0 or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, rto_max_ms)
    except OSError:
        return False
    if give_up_s > 0:
        ms = int(min(give_up_s + USER_TIMEOUT_MARGIN_S, MAX_USER_TIMEOUT_S) * 1000)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18), ms)
        except OSError:  # then the cap goes too: capped without it, the kernel would give up after about 15 s
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_RANGE[1])
            return False
    return True


def retransmitting(sock: socket.socket) -> str | None:
    """What the kernel says about `sock` when it is retransmitting unacknowledged data (the link drops packets), for a
    timeout's message; None when it is not (or the kernel does not say: TCP_INFO is Linux's)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < TCP_INFO_BYTES:
        return None
    _, _, retransmits, _, backoff, _, _, _, rto_us, _, _, _, unacked = struct.unpack_from("8B5I", info)
    if not unacked or not (retransmits or backoff):
        return None
    return (f"the link to it is retransmitting ({unacked} segments unacknowledged, retry {max(retransmits, backoff)}, "
            f"next in {rto_us / 1e6:.1f} s): the network between the hosts drops packets")


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
