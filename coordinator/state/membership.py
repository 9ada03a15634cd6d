"""The node registry: registration, heartbeats and failure detection (plain, not thread-safe alone)."""

from __future__ import annotations

import enum
import hmac
import secrets
from dataclasses import dataclass, field

from axond.coordinator.state.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    check_at_most,
    check_name,
    short,
)
from axond.coordinator.limits import CoordinatorLimits


class Health(enum.Enum):
    """How recently a node was heard from."""

    ALIVE = 1
    SUSPECT = 2
    DEAD = 3


@dataclass
class Node:
    """One registered worker (an agent of a job, or a daemon waiting for submitted jobs)."""

    node_id: str
    hostname: str
    seq: int
    slots: int
    daemon: bool
    last_seen: float
    dead: bool = False
    job: str = ""
    secret: str = field(default="", repr=False)
    """Proof of identity every node-scoped call carries (RegisterNodeResponse.node_secret)."""
    pids: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Per job it runs: (generation, pids of its local ranks) as its last heartbeat for that job reported them."""
    interval: float = 0.0
    """The heartbeat interval it was last told (0: the base interval)."""
    told_before: float = 0.0
    """The interval told before that: until its next heartbeat the node may still be pacing itself by it."""

    @property
    def order_key(self) -> tuple[str, int]:
        """Rank order: by hostname, then by registration order."""
        return (self.hostname, self.seq)


@dataclass(frozen=True)
class Liveness:
    """Failure-detection timing told to nodes."""

    heartbeat_interval: float
    dead_after_missed: int

    max_heartbeat_rate: float = 0.0
    """Heartbeats per second all nodes together may send (0: no bound, every node at `heartbeat_interval`)."""

    @property
    def dead_after(self) -> float:
        return self.heartbeat_interval * self.dead_after_missed

    def interval_for(self, nodes: int) -> float:
        """The heartbeat interval with `nodes` registered: the base, or longer so that they send at most
        `max_heartbeat_rate` heartbeats per second together."""
        if self.max_heartbeat_rate <= 0:
            return self.heartbeat_interval
        return max(self.heartbeat_interval, nodes / self.max_heartbeat_rate)


class Membership:
    """Registered nodes by id (plain; the caller holds the state's lock)."""

    def __init__(self, liveness: Liveness, limits: CoordinatorLimits | None = None) -> None:
        self.liveness = liveness
        self.limits = limits or CoordinatorLimits()
        self.nodes: dict[str, Node] = {}
        self._next_scan = float("-inf")
        self._seq = 0
        self._epoch = secrets.token_hex(2)
        self.track = False
        """Record changed and forgotten node ids (for the durable state's journal)."""
        self.changed: set[str] = set()
        self.forgotten: set[str] = set()

    def mark(self, node: Node) -> None:
        """The node's record changed (when tracking)."""
        if self.track:
            self.changed.add(node.node_id)

    def _forget(self, node_id: str) -> None:
        del self.nodes[node_id]
        if self.track:
            self.changed.discard(node_id)
            self.forgotten.add(node_id)

    def register(self, hostname: str, slots: int, daemon: bool, now: float) -> Node:
        check_name("hostname", hostname, self.limits.max_name_chars)
        if slots < 0:
            raise InvalidArgument(f"slots is {slots}; it must be >= 0")
        check_at_most("slots", slots, self.limits.max_nproc_per_node, "max_nproc_per_node")
        if daemon and slots < 1:
            raise InvalidArgument("a worker daemon must offer slots >= 1 (rank processes it can run)")
        if len(self.nodes) >= self.limits.max_nodes:
            for node_id in [n.node_id for n in self.nodes.values() if n.dead]:
                self._forget(node_id)
            if len(self.nodes) >= self.limits.max_nodes:
                raise ResourceExhausted(
                    f"the coordinator has {len(self.nodes)} registered nodes, its limit (max_nodes); "
                    "deregister idle workers or raise the limit"
                )
        self._seq += 1
        node = Node(f"n{self._seq}-{self._epoch}", hostname, self._seq, slots, daemon, now, secret=secrets.token_hex(16))
        self.nodes[node.node_id] = node
        node.interval = self.liveness.interval_for(len(self.nodes))
        self.mark(node)
        return node

    def get(self, node_id: str) -> Node:
        if not node_id:
            raise InvalidArgument("node_id must be non-empty (the id RegisterNode returned)")
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"unknown node {short(node_id)}: the coordinator may have restarted; register again")
        return node

    def authenticate(self, node_id: str, secret: str) -> Node:
        """The node, if `secret` is the one it registered with; PermissionDenied otherwise."""
        node = self.get(node_id)
        if not secret or not hmac.compare_digest(secret.encode(), node.secret.encode()):
            raise PermissionDenied(
                f"node {short(node_id)}: {'missing' if not secret else 'wrong'} node secret; node-scoped calls "
                "must carry the node_secret RegisterNode returned to that node"
            )
        return node

    def touch(self, node_id: str, now: float) -> tuple[Node, bool]:
        """Record that the node was heard from; returns (node, whether it had been declared dead)."""
        node = self.get(node_id)
        was_dead = node.dead
        node.last_seen = now
        node.dead = False
        if was_dead:
            self.mark(node)
        return node, was_dead

    def heartbeat(self, node_id: str, now: float, local_pids: tuple[int, ...] = (), renew: bool = True,
                  job: str = "", generation: int = 0) -> Node:
        """Record a heartbeat, with the pids of the node's local ranks of `generation` of `job` if it sent them;
        `renew` False: answer it without renewing the lease (a heartbeat queued while the coordinator was stalled)."""
        node, _ = self.touch(node_id, now) if renew else (self.get(node_id), False)
        told = self.liveness.interval_for(len(self.nodes))
        if told != node.interval:
            node.told_before, node.interval = node.interval, told
            self.mark(node)
        else:
            node.told_before = 0.0
        if local_pids and job:
            check_at_most("local_pids", len(local_pids), self.limits.max_nproc_per_node, "max_nproc_per_node")
            node.pids[job] = (generation, tuple(local_pids))
        return node

    def rearm(self, away: float, now: float) -> int:
        """The coordinator did not run for `away` seconds (stopped, stalled): that time counts against no node's
        lease. Returns how many live nodes were re-armed."""
        count = 0
        for node in self.nodes.values():
            if not node.dead:
                node.last_seen = min(now, node.last_seen + away)
                count += 1
        return count

    def paced(self, node: Node) -> float:
        """The longest interval the node may be heartbeating at: what it was told, or told before."""
        return max(node.interval, node.told_before, self.liveness.heartbeat_interval)

    def health(self, node: Node, now: float) -> Health:
        if node.dead:
            return Health.DEAD
        if now - node.last_seen > 1.5 * self.paced(node):
            return Health.SUSPECT
        return Health.ALIVE

    def newly_dead(self, now: float) -> list[Node]:
        """Mark and return nodes silent for longer than `dead_after`; forget long-dead ones.

        Every node is looked at no more often than every 1/20 of the current interval (10,000 nodes:
        once a second, not at every tick), so detection is that much later at most.
        """
        if now < self._next_scan:
            return []
        self._next_scan = now + self.liveness.interval_for(len(self.nodes)) / 20
        out = []
        for node in list(self.nodes.values()):
            silent = now - node.last_seen
            if not node.dead and silent > self.paced(node) * self.liveness.dead_after_missed:
                node.dead = True
                self.mark(node)
                out.append(node)
            elif node.dead and silent > 20 * self.liveness.dead_after + 60.0:
                self._forget(node.node_id)
        return out

    def remove(self, node_id: str) -> Node:
        node = self.get(node_id)
        self._forget(node_id)
        return node
