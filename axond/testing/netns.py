"""Hosts on one Linux machine as network namespaces joined by a switch, for cross-host tests and benchmarks.

`Network.create(n)` builds n namespaces ("hosts"), each with `lo` up and one veth `eth0` whose
peer sits on a bridge inside a separate switch namespace; host i has address SUBNET.(i + 1). Nothing
is added to the machine's own namespace (no interface, route or address), so no traffic can reach
the real network, and the switch namespace has no firewall rules of the machine's to drop bridged
frames. Processes start in a host with `Host.popen` (`ip netns exec`, under a hostname of their own);
`link_down`/`link_up` cut one host's cable on its side or the switch's, and `Host.vanish` removes a host
mid-job. `Network.close` (idempotent) kills every process in the namespaces and deletes them;
namespaces of a process that died before closing are swept at the next `Network.create`.

Needs root and iproute2's `ip netns`; `unavailable()` says why not.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = ["Host", "Network", "NetnsError", "unavailable"]

PREFIX = "axond-ns"
"""Namespace names are PREFIX-<pid>-<serial>-<role>: the pid lets a later run sweep leftovers of a dead one."""
DEFAULT_SUBNET = "10.213.0"
"""Host i gets DEFAULT_SUBNET.(i + 1)/24: a private range, present only inside the namespaces."""
IFNAME = "eth0"
"""Each host's interface towards the switch."""
_serial = itertools.count()
Side = Literal["host", "switch"]


class NetnsError(RuntimeError):
    """A namespace command failed (the message carries the command and its stderr)."""


def _ip_binary() -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    return shutil.which("ip", path=path)


def unavailable() -> str | None:
    """Why namespace hosts cannot be built here (None if they can): not Linux, not root, or no `ip netns`."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespace hosts need root (ip netns add); run the tests as root"
    ip = _ip_binary()
    if ip is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    try:
        probe = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns list` failed: {e}"
    if probe.returncode != 0:
        return f"`ip netns` is not usable: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    ip = _ip_binary()
    if ip is None:
        raise NetnsError("iproute2's `ip` is not installed")
    try:
        done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish in {timeout} s") from e
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _kill_all(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process in namespace `ns` until none is left (children forked meanwhile included)."""
    deadline = time.monotonic() + timeout
    while (pids := _pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove(ns: str) -> None:
    _kill_all(ns)
    _ip("netns", "delete", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone (a killed test run); returns their names."""
    swept = []
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-\w+", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _remove(ns)
            swept.append(ns)
    return swept


class Host:
    """One namespace host: its name, address and interface; start processes in it, cut its link."""

    def __init__(self, network: Network, index: int, ns: str, addr: str) -> None:
        self.network = network
        self.index = index
        self.ns = ns
        """The namespace's name (`ip netns exec NS ...`)."""
        self.addr = addr
        """This host's IPv4 address on the switch."""
        self.ifname = IFNAME
        self.hostname = f"nshost{index}"
        """What `socket.gethostname()` returns in processes started by `popen`."""
        self.port_name = f"h{index}"
        """The switch's port (veth) facing this host, in the switch namespace."""
        self.alive = True
        self.procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.addr}, ns={self.ns!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run in this host: its network namespace, and a UTS namespace with its hostname when possible."""
        ip = _ip_binary() or "ip"
        unshare = shutil.which("unshare")
        if unshare is None:
            return [ip, "netns", "exec", self.ns, *argv]
        return [ip, "netns", "exec", self.ns, unshare, "--uts", "--", "/bin/sh", "-c",
                'printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"', self.hostname, *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` in this host (`subprocess.Popen` keyword arguments pass through); killed by `close`."""
        if not self.alive:
            raise NetnsError(f"host {self.index} ({self.ns}) was removed; it cannot start {argv[0]!r}")
        proc = subprocess.Popen(self.command(argv), env=dict(env) if env is not None else None, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 30.0,
            ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in this host to completion (output captured as text); raises TimeoutExpired after `timeout`."""
        return subprocess.run(self.command(argv), env=dict(env) if env is not None else None, capture_output=True,
                              text=True, timeout=timeout)

    def _link(self, state: str, side: Side) -> None:
        if side == "host":
            _ip("-n", self.ns, "link", "set", self.ifname, state)
        elif side == "switch":
            _ip("-n", self.network.switch, "link", "set", self.port_name, state)
        else:
            raise ValueError(f"side must be 'host' or 'switch', got {side!r}")

    def link_down(self, side: Side = "host") -> None:
        """Cut this host's cable: on its side (its routes go, sends fail at once) or the switch's (frames vanish)."""
        self._link("down", side)

    def link_up(self, side: Side = "host") -> None:
        """Reconnect the cable cut by `link_down(side)` (the host side's routes come back with its address)."""
        self._link("up", side)

    def drop_frames(self, drop: bool) -> None:
        """Have the switch drop every frame to and from this host (True) or forward them again (False), its link
        up all along: what a firewall's DROP rule does (the bridge port's state: disabled or forwarding)."""
        bridge = shutil.which("bridge", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
        if bridge is None:
            raise NetnsError("iproute2's `bridge` is not installed")
        argv = [bridge, "-n", self.network.switch, "link", "set", "dev", self.port_name,
                "state", "0" if drop else "3"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")

    def pids(self) -> list[int]:
        """Every process in this host."""
        return _pids(self.ns) if self.alive else []

    def kill_all(self) -> None:
        """SIGKILL every process in this host."""
        _kill_all(self.ns)

    def vanish(self) -> None:
        """The machine disappears mid-job: its switch port goes down first (so no FIN or RST escapes), then
        every process in it is killed and the namespace deleted, its link with it."""
        if not self.alive:
            return
        self.link_down("switch")
        self.kill_all()
        _ip("netns", "delete", self.ns, check=False)
        self.alive = False
        for proc in self.procs:
            _reap(proc)


def _reap(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class Network:
    """N hosts on one switch; use as a context manager or call `close`."""

    def __init__(self, tag: str, switch: str, mtu: int) -> None:
        self.tag = tag
        self.switch = switch
        """The switch namespace's name (holds the bridge `br0` and one port per host)."""
        self.mtu = mtu
        self.hosts: list[Host] = []
        self._closed = False

    @classmethod
    def create(cls, n_hosts: int = 3, mtu: int = 1500, subnet: str = DEFAULT_SUBNET) -> Network:
        """Build `n_hosts` hosts (addresses subnet.1 ... subnet.n) on a switch with interfaces of `mtu` bytes."""
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be 1..200, got {n_hosts}")
        if not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be 68..65535 bytes (1500 Ethernet, 9000 jumbo), got {mtu}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets of an IPv4 /24, e.g. '10.213.0', got {subnet!r}")
        reason = unavailable()
        if reason:
            raise NetnsError(reason)
        sweep_stale()
        tag = f"{PREFIX}-{os.getpid()}-{next(_serial)}"
        net = cls(tag, f"{tag}-sw", mtu)
        try:
            net._build(n_hosts, subnet)
        except BaseException:
            net.close()
            raise
        return net

    def _build(self, n_hosts: int, subnet: str) -> None:
        mtu = str(self.mtu)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "mtu", mtu, "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(n_hosts):
            host = Host(self, i, f"{self.tag}-h{i}", f"{subnet}.{i + 1}")
            _ip("netns", "add", host.ns)
            self.hosts.append(host)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "link", "add", host.ifname, "mtu", mtu, "type", "veth",
                "peer", "name", host.port_name, "mtu", mtu, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", host.port_name, "master", "br0", "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.ns, "link", "set", host.ifname, "up")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the hosts and delete the namespaces (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            if host.alive:
                _remove(host.ns)
                host.alive = False
            for proc in host.procs:
                _reap(proc)
        _remove(self.switch)
