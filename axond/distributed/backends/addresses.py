"""This machine's addresses as peers reach it: an interface's, the one on the route to a host, and the one a rank
advertises (shared by every backend that listens, the worker and the torch backend)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from urllib.parse import urlsplit

from axond.config import RuntimeEnv
from axond.errors import DistributedError

SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str:
    """IPv4 address of network interface `ifname` (for AXOND_SOCKET_IFNAME on multi-homed hosts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError as e:
            raise DistributedError(
                f"AXOND_SOCKET_IFNAME={ifname!r}: no IPv4 address on that interface ({e}); "
                "set it to an interface listed by `ip addr`"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str) -> str | None:
    """This machine's address on the route to `host` (no packet is sent); None for loopback or unresolvable hosts."""
    try:
        if not host or ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None


def advertised_host(configured: str | None, env: RuntimeEnv | None = None) -> str:
    """Address peers should reach this rank at: configured, else the interface (AXOND_SOCKET_IFNAME of `env`), else
    the route to the coordinator (AXOND_COORDINATOR) or to the rendezvous host (MASTER_ADDR), else loopback."""
    if configured:
        return configured
    env = env if env is not None else RuntimeEnv()
    if env.socket_ifname:
        return interface_address(env.socket_ifname)
    coordinator = env.coordinator.split(",")[0]  # replicas: any one shows the route
    for toward in (urlsplit("//" + coordinator).hostname, env.master_addr):
        address = route_address(toward or "")
        if address:
            return address
    return "127.0.0.1"
