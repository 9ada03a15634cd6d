"""The nodes of one job generation vouch for each other while the coordinator does not answer.

Each node of a running generation listens on a small TCP port (`PeerLink`) and publishes its address in
the generation's store; the others read the addresses as soon as they are there. When a node's
heartbeats go unanswered for a whole lease it asks its peers (`probe`): each answers, authenticated with
the generation's secret, which generation it runs and how long its own heartbeats have gone unanswered.
A peer in the same generation that lost the coordinator too says the coordinator is away (an outage:
keep training); a peer that still reaches the coordinator, or no answer at all, says this node is the one
cut off (stop its ranks). A peer whose contact came back says since when (`contact_for`), so that a node still
without it knows how long the coordinator's fresh lease lasts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from axond.fencing import PROBE_TIMEOUT_S
from axond.store.coordinator import CoordinatorStore
from axond.distributed.backends.addresses import interface_address, route_address
from axond.errors import CoordinatorError, StoreError

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

MAX_PROBED = 4
"""Peers each node learns the address of and asks (the next ones by node rank): enough to tell an outage
from a partition, at a cost that does not grow with the job."""
_MAX_LINE = 1024
_NEVER = 1e9
"""contact_for as sent for "never lost" (JSON has no infinity)."""
_KEY = "axond/peer/{}"


@dataclass(frozen=True)
class PeerView:
    """One peer's answer to a probe."""

    node_rank: int
    generation: int
    """The generation of the job it runs (0: none, or it has stopped running the one asked about)."""
    silent_for: float
    """Seconds since its last answered heartbeat."""
    lease: float
    """Its lease: silent_for above half of it means it too lost the coordinator."""
    contact_for: float = float("inf")
    """Seconds since its contact with the coordinator came back after a failed heartbeat (inf: never lost)."""

    @property
    def lost_coordinator(self) -> bool:
        return self.silent_for >= self.lease / 2


def _mac(secret: bytes, *parts: object) -> str:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def advertised_host(coordinator: str, env: Mapping[str, str], ifname: str | None) -> str:
    """Where peers reach this node: AXOND_SOCKET_IFNAME's address (the job's `env`, else the worker's `ifname`), else
    the route to the coordinator, else loopback."""
    ifname = env.get("AXOND_SOCKET_IFNAME") or ifname
    if ifname:
        return interface_address(ifname)
    host = urlsplit("//" + coordinator.split(",")[0]).hostname or ""
    return route_address(host) or "127.0.0.1"


class PeerLink:
    """This node's part in one generation's mutual checks: the listener, and the peers' addresses."""

    def __init__(self, client: CoordinatorClient, job: str, generation: int, node_rank: int, nnodes: int,
                 secret: bytes, silent_for: Callable[[], float], lease: Callable[[], float],
                 contact_for: Callable[[], float] = lambda: float("inf"), env: Mapping[str, str] | None = None,
                 wait_s: float = 300.0, ifname: str | None = None) -> None:
        self._client, self.job, self.generation = client, job, generation
        self.node_rank, self.nnodes, self._secret = node_rank, nnodes, secret
        self._silent_for, self._lease, self._contact_for = silent_for, lease, contact_for
        self._wait_s = wait_s
        self._closed = threading.Event()
        self.peers: dict[int, tuple[str, int]] = {}
        """The other nodes' addresses, by node rank, as far as they are known yet."""
        host = advertised_host(client.address, env or {}, ifname)
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.5)
        self.address = (host, self._listener.getsockname()[1])
        self._threads = [threading.Thread(target=self._serve, name=f"axond-peers-{job}", daemon=True)]
        if nnodes > 1:
            self._threads.append(threading.Thread(target=self._exchange, name=f"axond-peer-addrs-{job}", daemon=True))
        for t in self._threads:
            t.start()

    def _exchange(self) -> None:
        """Publish this node's address in the generation's store and read the others' (bounded, retried)."""
        store = CoordinatorStore(self._client, self.job, self.generation)  # one KV stream: cheap for the coordinator
        deadline = time.monotonic() + self._wait_s
        published = False
        try:
            wanted = [(self.node_rank + i) % self.nnodes for i in range(1, min(self.nnodes, MAX_PROBED + 1))]
            while not self._closed.is_set() and time.monotonic() < deadline and len(self.peers) < len(wanted):
                try:
                    if not published:
                        store.set(_KEY.format(self.node_rank), f"{self.address[0]} {self.address[1]}".encode())
                        published = True
                    missing = [r for r in wanted if r not in self.peers]
                    store.wait([_KEY.format(r) for r in missing], timeout=5.0)
                    for rank in missing:
                        host, port = store.get(_KEY.format(rank), timeout=0).decode().split()
                        self.peers[rank] = (host, int(port))
                except (StoreError, CoordinatorError, ValueError):
                    self._closed.wait(0.5)
        finally:
            store.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ValueError, KeyError, TypeError):
                    pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(PROBE_TIMEOUT_S)
        req = json.loads(_read_line(conn))
        job, gen, nonce = str(req["job"]), int(req["generation"]), str(req["nonce"])
        if not hmac.compare_digest(str(req["mac"]), _mac(self._secret, "ask", job, gen, nonce)):
            return
        running = self.generation if (job, gen) == (self.job, self.generation) and not self._closed.is_set() else 0
        silent, lease = round(self._silent_for(), 3), round(self._lease(), 3)
        contact = round(min(self._contact_for(), _NEVER), 3)
        reply = {"generation": running, "silent_for": silent, "lease": lease, "contact_for": contact,
                 "mac": _mac(self._secret, "tell", nonce, running, silent, lease, contact)}
        conn.sendall(json.dumps(reply).encode() + b"\n")

    def _ask(self, rank: int, address: tuple[str, int]) -> PeerView | None:
        nonce = secrets.token_hex(8)
        req = {"job": self.job, "generation": self.generation, "nonce": nonce,
               "mac": _mac(self._secret, "ask", self.job, self.generation, nonce)}
        try:
            with socket.create_connection(address, timeout=PROBE_TIMEOUT_S) as conn:
                conn.settimeout(PROBE_TIMEOUT_S)
                conn.sendall(json.dumps(req).encode() + b"\n")
                rep = json.loads(_read_line(conn))
            gen, silent, lease = int(rep["generation"]), float(rep["silent_for"]), float(rep["lease"])
            contact = float(rep["contact_for"])
            if not hmac.compare_digest(str(rep["mac"]),
                                       _mac(self._secret, "tell", nonce, gen, silent, lease, contact)):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return PeerView(rank, gen, silent, lease, float("inf") if contact >= _NEVER else contact)

    def probe(self) -> list[PeerView | None]:
        """Ask the known peers (up to `MAX_PROBED`: the next node ranks after this one) at once: their answers,
        None for each that did not answer."""
        known = list(self.peers.items())
        if not known:
            return []
        with ThreadPoolExecutor(len(known)) as pool:
            return list(pool.map(lambda kv: self._ask(*kv), known))

    def unreachable(self, tries: int = 2) -> list[int]:
        """The node ranks of the known peers that answer no connection at all, `tries` times within PROBE_TIMEOUT_S
        each (no handshake, no reset: the frames between here and there are dropped). A refused connection is an
        answer: that host is reachable. Probed at once; the first try that answers ends a peer's probes."""
        known = list(self.peers.items())
        if not known:
            return []

        def silent(address: tuple[str, int]) -> bool:
            for _ in range(tries):
                try:
                    with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
                        return False
                except ConnectionRefusedError:
                    return False
                except OSError:  # timed out, no route to host, network unreachable
                    continue
            return True

        with ThreadPoolExecutor(len(known)) as pool:
            found = list(pool.map(lambda kv: silent(kv[1]), known))
        return sorted(rank for (rank, _), lost in zip(known, found) if lost)

    def close(self) -> None:
        """Stop answering (peers asking from now on hear nothing)."""
        self._closed.set()
        self._listener.close()  # its threads end by themselves (daemons, within a call's time): no wait here


def _read_line(conn: socket.socket) -> bytes:
    """One line of at most _MAX_LINE bytes, all of it within PROBE_TIMEOUT_S (a client dripping bytes cannot hold
    the one serving thread longer)."""
    data, deadline = b"", time.monotonic() + PROBE_TIMEOUT_S
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError("no whole line in time")
        conn.settimeout(left)
        chunk = conn.recv(_MAX_LINE - len(data))
        if not chunk:
            raise ValueError("closed before a whole line")
        data += chunk
        if len(data) >= _MAX_LINE:
            raise ValueError("line too long")
    return data
