"""One rendezvous round: collect joiners, freeze the membership and assign ranks.

Ranks are deterministic: members are ordered by (hostname, registration order of the node), hostnames
in natural order (`w-2` before `w-10`: Kubernetes Indexed Job pods `JOB-INDEX` get their completion
index as node rank), node ranks follow that order, and each node gets a contiguous block of global ranks of its
`nproc` size.
The same set of registered nodes therefore always gets the same ranks, whatever order they join in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIGITS = re.compile(r"(\d+)")


def natural_order(key: tuple[str, int]) -> tuple[tuple[str | int, ...], int]:
    """`(hostname, seq)` with the hostname's digit runs compared as numbers."""
    parts = _DIGITS.split(key[0])
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), key[1]


@dataclass(frozen=True)
class Member:
    """A node's place in a frozen generation."""

    node_id: str
    hostname: str
    nproc: int
    node_rank: int
    rank_offset: int


@dataclass(frozen=True)
class _Joiner:
    order_key: tuple[str, int]
    hostname: str
    nproc: int


class Round:
    """The membership of one generation: open while nodes join, frozen once ranks are assigned.

    It freezes as soon as `max_nodes` joined, or `settle_time` after `min_nodes` joined (late
    joiners within that window are taken too).
    """

    def __init__(self, generation: int, min_nodes: int, max_nodes: int, settle_time: float, secret: bytes) -> None:
        self.generation = generation
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.settle_time = settle_time
        self.secret = secret
        self.joiners: dict[str, _Joiner] = {}
        self.min_reached_at: float | None = None
        self.members: list[Member] | None = None
        self._by_node: dict[str, Member] = {}
        self.joined_ranks = 0
        """Ranks of the joiners so far (kept as they come and go: O(1) per Join at 10,000 nodes)."""
        self._world: tuple[list[Member] | None, int] = (None, 0)
        self.dirty: dict[str, bool] = {}
        """Joiners added, updated or removed since the journal last read them (node id -> removed at some
        point): a durable state writes only these (O(1) per Join, not the whole round per commit)."""
        self.reordered = False
        """A joiner was removed and added again since then (it moved to the end of `joiners`)."""
        self.expected: frozenset[str] = frozenset()
        """Live recovery: the surviving nodes of the previous generation; the round freezes as soon as all of them
        joined (no settle time: nobody else is awaited)."""
        self.not_before = 0.0
        """It freezes no earlier than this (monotonic): after a node of the previous generation was declared dead,
        the time that node's worker may still take to kill its ranks (the fence)."""

    @property
    def frozen(self) -> bool:
        return self.members is not None

    @property
    def world_size(self) -> int:
        """Ranks of the frozen generation (0 while open); summed once per membership, not per call."""
        members = self.members
        if members is None:
            return 0
        if self._world[0] is not members:
            self._world = (members, sum(m.nproc for m in members))
        return self._world[1]

    def add(self, node_id: str, order_key: tuple[str, int], nproc: int, now: float) -> None:
        """Add or update a joiner of this open round."""
        old = self.joiners.get(node_id)
        self.joined_ranks += nproc - (old.nproc if old is not None else 0)
        self.joiners[node_id] = _Joiner(order_key, order_key[0], nproc)
        if self.dirty.get(node_id):
            self.reordered = True
        else:
            self.dirty[node_id] = False
        if self.min_reached_at is None and len(self.joiners) >= self.min_nodes:
            self.min_reached_at = now

    def remove(self, node_id: str) -> bool:
        """Drop a joiner that left before the freeze."""
        if self.frozen:
            return False
        old = self.joiners.pop(node_id, None)
        if old is None:
            return False
        self.joined_ranks -= old.nproc
        self.dirty[node_id] = True
        if len(self.joiners) < self.min_nodes:
            self.min_reached_at = None
        return True

    def freeze_at(self) -> float | None:
        """When the open round freezes on its own, or None if it still lacks `min_nodes`."""
        if self.frozen or self.min_reached_at is None:
            return None
        if len(self.joiners) >= self.max_nodes or (self.expected and self.expected <= self.joiners.keys()):
            return max(self.min_reached_at, self.not_before)
        return max(self.min_reached_at + self.settle_time, self.not_before)

    def maybe_freeze(self, now: float) -> bool:
        """Freeze if it is time; returns True when this call froze the round."""
        at = self.freeze_at()
        if at is None or now < at:
            return False
        ordered = sorted(self.joiners.items(), key=lambda kv: natural_order(kv[1].order_key))[: self.max_nodes]
        members, offset = [], 0
        for node_rank, (node_id, j) in enumerate(ordered):
            members.append(Member(node_id, j.hostname, j.nproc, node_rank, offset))
            offset += j.nproc
        self.members = members
        self._by_node = {m.node_id: m for m in members}
        return True

    def member(self, node_id: str) -> Member | None:
        return self._by_node.get(node_id)
