"""Forming the full mesh of a group: listen, publish the address in the KV store, connect, authenticate.

Rank i connects to every lower rank and accepts every higher one. Each connection runs a mutual
HMAC challenge-response over the job secret (the secret never crosses the wire); a connection
that cannot prove it is refused and the group keeps waiting for the real member.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

from axond.errors import DistributedError, StoreError
from axond.store import Store

MAGIC = b"AXD1"
HELLO = struct.Struct("<4sIii16s")
"""magic, group id, connecting rank, group size, connector nonce."""
CHALLENGE = struct.Struct("<4sB16s32s")
"""magic, status, acceptor nonce, acceptor proof."""
PROOF_SIZE = 32
ACCEPTED, REFUSED = 1, 2
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


def advertised_host(configured: str | None) -> str:
    """Address peers should reach this rank at: configured, else the interface, else the route to the coordinator."""
    if configured:
        return configured
    ifname = os.environ.get("AXOND_SOCKET_IFNAME")
    if ifname:
        return interface_address(ifname)
    coordinator = os.environ.get("AXOND_COORDINATOR")
    if coordinator:
        host = urlsplit("//" + coordinator).hostname or ""
        try:
            if host and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((host, 9))
                    return str(s.getsockname()[0])
        except OSError:
            pass
    return "127.0.0.1"


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes, gid: int, a: int, b: int) -> bytes:
    return hmac.new(secret, role + first + second + struct.pack("<Iii", gid, a, b), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


class Mesh:
    """Builds the authenticated sockets of one group member: {peer group rank: socket}."""

    def __init__(self, store: Store, rank: int, size: int, gid: int, secret: bytes, host: str | None,
                 port: int, timeout: float, describe: str) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.gid = gid
        self.secret = secret
        self.timeout = timeout
        self.describe = describe
        self.host = advertised_host(host)
        self.port = port
        self.refused = 0
        """Connections refused so far (wrong secret, wrong group): visible to tests and logs."""

    def _err(self, what: str, peer: int | None = None) -> DistributedError:
        return DistributedError(f"init on {self.describe}: {what}", op="init", peer=peer)

    def connect_all(self) -> dict[int, socket.socket]:
        """Return a connected, authenticated socket per peer, or raise `DistributedError` by the deadline."""
        deadline = time.monotonic() + self.timeout
        listener = socket.create_server((self.host, self.port), backlog=max(self.size, 16))
        listener.settimeout(0.1)
        socks: dict[int, socket.socket] = {}
        accept_error: list[BaseException] = []
        try:
            self.store.set(f"addr/{self.rank}", f"{self.host}:{listener.getsockname()[1]}".encode())
            acceptor = threading.Thread(
                target=self._accept_loop, args=(listener, socks, deadline, accept_error),
                name=f"axond-accept-{self.rank}", daemon=True,
            )
            acceptor.start()
            try:
                for peer in range(self.rank):
                    socks[peer] = self._connect(peer, deadline)
            finally:
                acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if accept_error:
                raise accept_error[0]
            missing = [p for p in range(self.rank + 1, self.size) if p not in socks]
            if missing:
                raise self._err(f"timed out after {self.timeout:.1f} s waiting for peer ranks {missing} to connect", missing[0])
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            listener.close()
        return socks

    def _connect(self, peer: int, deadline: float) -> socket.socket:
        try:
            raw = self.store.get(f"addr/{peer}", max(0.0, deadline - time.monotonic()))
        except StoreError as e:
            raise self._err(f"peer rank {peer} never published its address: {e}", peer) from e
        host, _, port = raw.decode().rpartition(":")
        return self._connect_to(peer, host, int(port), deadline)

    def _connect_to(self, peer: int, host: str, port: int, deadline: float) -> socket.socket:
        """Connect to `peer` at host:port (retrying until `deadline`) and run the handshake."""
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise self._err(f"could not connect to peer rank {peer} at {host}:{port}: {e}", peer) from e
                time.sleep(0.05)
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            nonce = secrets.token_bytes(16)
            sock.sendall(HELLO.pack(MAGIC, self.gid, self.rank, self.size, nonce))
            magic, status, peer_nonce, proof = CHALLENGE.unpack(_recv_exact(sock, CHALLENGE.size))
            if magic != MAGIC or status == REFUSED:
                raise self._err(f"peer rank {peer} at {host}:{port} refused the connection "
                                "(different job, group or world size?)", peer)
            expected = _proof(self.secret, b"A", nonce, peer_nonce, self.gid, self.rank, peer)
            if not hmac.compare_digest(proof, expected):
                raise self._err(f"peer rank {peer} at {host}:{port} could not prove the job secret; "
                                "refusing it (do both ranks have the same AXOND_JOB_SECRET?)", peer)
            sock.sendall(_proof(self.secret, b"C", peer_nonce, nonce, self.gid, self.rank, peer))
            verdict = _recv_exact(sock, 1)
            if verdict[0] != ACCEPTED:
                raise self._err(f"peer rank {peer} refused the connection: wrong job secret "
                                "(check AXOND_JOB_SECRET)", peer)
        except DistributedError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            raise self._err(f"handshake with peer rank {peer} at {host}:{port} failed: {e}", peer) from e
        return sock

    def _accept_loop(self, listener: socket.socket, socks: dict[int, socket.socket], deadline: float,
                     errors: list[BaseException]) -> None:
        expected = set(range(self.rank + 1, self.size))
        try:
            while expected and time.monotonic() < deadline:
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                peer = self._authenticate(sock, expected, deadline)
                if peer is None:
                    self.refused += 1
                    sock.close()
                    continue
                expected.discard(peer)
                socks[peer] = sock
        except BaseException as e:
            errors.append(e)

    def _authenticate(self, sock: socket.socket, expected: set[int], deadline: float) -> int | None:
        """The peer rank if the connection proves the secret and belongs here, else None."""
        try:
            sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            magic, gid, peer, size, nonce = HELLO.unpack(_recv_exact(sock, HELLO.size))
            my_nonce = secrets.token_bytes(16)
            if magic != MAGIC or gid != self.gid or size != self.size or peer not in expected:
                sock.sendall(CHALLENGE.pack(MAGIC, REFUSED, my_nonce, bytes(32)))
                return None
            sock.sendall(CHALLENGE.pack(MAGIC, ACCEPTED, my_nonce,
                                        _proof(self.secret, b"A", nonce, my_nonce, self.gid, peer, self.rank)))
            proof = _recv_exact(sock, PROOF_SIZE)
            if not hmac.compare_digest(proof, _proof(self.secret, b"C", my_nonce, nonce, self.gid, peer, self.rank)):
                sock.sendall(bytes([REFUSED]))
                return None
            sock.sendall(bytes([ACCEPTED]))
            return int(peer)
        except (OSError, struct.error, ConnectionError):
            return None
