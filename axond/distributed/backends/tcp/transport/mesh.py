"""Forming the full mesh of a group: listen, publish the address in the KV store, connect, authenticate.

Rank i connects to every lower rank and accepts every higher one. Each connection runs a mutual
HMAC challenge-response over the job secret (the secret never crosses the wire; see `handshake`);
a connection that cannot prove it within its deadline is dropped and the group keeps waiting for
the real member, whose handshakes run beside the stranger's instead of behind it.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time

from axond.distributed.backends.addresses import advertised_host
from axond.distributed.backends.tcp.transport.handshake import (
    ACCEPTED, CHALLENGE, HANDSHAKE_TIMEOUT, HELLO, MAGIC, MAX_PENDING, REFUSED, Acceptor, proof, recv_exact,
)
from axond.errors import DistributedError, StoreError, rank_list
from axond.store import Store

RETRY_PAUSE = 0.05
"""Seconds between a connector's attempts while the peer is not listening yet or dropped the connection."""


class Mesh:
    """Builds the authenticated sockets of one group member: {peer group rank: socket}."""

    def __init__(self, store: Store, rank: int, size: int, gid: int, secret: bytes, host: str | None,
                 port: int, timeout: float, describe: str, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        if not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be positive seconds, got {handshake_timeout!r}")
        self.store = store
        self.rank = rank
        self.size = size
        self.gid = gid
        self.secret = secret
        self.timeout = timeout
        self.handshake_timeout = handshake_timeout
        self.describe = describe
        self.host = advertised_host(host)
        self.port = port
        self.refused = 0
        """Connections refused so far (wrong secret, wrong group): visible to tests and logs."""
        self.dropped = 0
        """Connections dropped without an answer (closed, too slow, or pushed out by a flood)."""

    def _err(self, what: str, peer: int | None = None) -> DistributedError:
        return DistributedError(f"init on {self.describe}: {what}", op="init", peer=peer)

    def connect_all(self) -> dict[int, socket.socket]:
        """Return a connected, authenticated socket per peer, or raise `DistributedError` by the deadline."""
        deadline = time.monotonic() + self.timeout
        listener = socket.create_server((self.host, self.port), backlog=max(self.size, MAX_PENDING))
        acceptor = Acceptor(listener, self.secret, self.gid, self.rank, self.size, self.handshake_timeout)
        socks: dict[int, socket.socket] = {}
        accept_error: list[BaseException] = []
        stop = threading.Event()

        def accept() -> None:
            try:
                acceptor.run(set(range(self.rank + 1, self.size)), socks, deadline, stop)
            except BaseException as e:  # noqa: BLE001 - handed to the connecting thread, which raises it
                accept_error.append(e)

        try:
            self.store.set(f"addr/{self.rank}", f"{self.host}:{listener.getsockname()[1]}".encode())
            thread = threading.Thread(target=accept, name=f"axond-accept-{self.rank}", daemon=True)
            thread.start()
            try:
                for peer in range(self.rank):
                    socks[peer] = self._connect(peer, deadline)
            except BaseException:
                stop.set()
                raise
            finally:
                thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
                self.refused, self.dropped = acceptor.refused, acceptor.dropped
            if accept_error:
                raise accept_error[0]
            missing = [p for p in range(self.rank + 1, self.size) if p not in socks]
            if missing:
                raise self._err(f"timed out after {self.timeout:.1f} s waiting for peer ranks {rank_list(missing)} "
                                "to connect",
                                missing[0])
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
        """Connect to `peer` at host:port and run the handshake, retrying until `deadline` while the peer is not
        listening yet or drops the connection unanswered (busy with a flood of strangers)."""
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise self._err(f"could not connect to peer rank {peer} at {host}:{port}: {e}", peer) from e
                time.sleep(RETRY_PAUSE)
                continue
            try:
                self._offer(sock, peer, f"{host}:{port}", min(deadline, time.monotonic() + 2 * self.handshake_timeout))
                return sock
            except DistributedError:
                sock.close()
                raise
            except OSError as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise self._err(f"handshake with peer rank {peer} at {host}:{port} failed: {e}", peer) from e
                time.sleep(RETRY_PAUSE)

    def _offer(self, sock: socket.socket, peer: int, where: str, deadline: float) -> None:
        """Run the connector's side of the handshake on `sock`: DistributedError if refused, OSError if cut short."""
        nonce = secrets.token_bytes(16)
        sock.sendall(HELLO.pack(MAGIC, self.gid, self.rank, self.size, nonce))
        magic, status, peer_nonce, theirs = CHALLENGE.unpack(recv_exact(sock, CHALLENGE.size, deadline))
        if magic != MAGIC or status == REFUSED:
            raise self._err(f"peer rank {peer} at {where} refused the connection "
                            "(different job, group or world size?)", peer)
        if not hmac.compare_digest(theirs, proof(self.secret, b"A", nonce, peer_nonce, self.gid, self.rank, peer)):
            raise self._err(f"peer rank {peer} at {where} could not prove the job secret; "
                            "refusing it (do both ranks have the same AXOND_JOB_SECRET?)", peer)
        sock.sendall(proof(self.secret, b"C", peer_nonce, nonce, self.gid, self.rank, peer))
        if recv_exact(sock, 1, deadline)[0] != ACCEPTED:
            raise self._err(f"peer rank {peer} refused the connection: wrong job secret "
                            "(check AXOND_JOB_SECRET)", peer)
