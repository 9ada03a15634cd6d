"""Which members of a group share a node.

A group whose members are spread over nodes, with several on each, runs large collectives in two
levels (see `shm_plan`): the members of a node through their shared-memory arena, and, between nodes,
each member only with its counterparts (the members with the same index on the other nodes) over the
sockets. So a node sends the data across once, split over its members' links,
instead of a flat ring sending every byte through loopback and across the network in turn.

Members are on one node when they advertise the same address (what peers connect to: the interface
of AXOND_SOCKET_IFNAME, else the route to the coordinator, else 127.0.0.1). Each member learns every
other's at the group's first large op (`describe`, `Topology.parse`), so every member derives the
same topology; whether a node can really share memory is then checked by mapping its arena.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOST_BYTES = 56
RECORD_BYTES = HOST_BYTES + 8
"""One member's description: its advertised address (NUL-padded), then its arena size (int64, little-endian)."""


def describe(host: str, arena_bytes: int) -> np.ndarray:
    """This member's record for `Topology.parse` (an address longer than HOST_BYTES is cut: it only names a node)."""
    out = np.zeros(RECORD_BYTES, np.uint8)
    raw = host.encode()[:HOST_BYTES]
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    out[HOST_BYTES:] = np.frombuffer(np.array(arena_bytes, "<i8").tobytes(), np.uint8)
    return out


@dataclass(frozen=True)
class Topology:
    """The nodes of a group: lists of group ranks, ordered by their lowest rank; ranks ascending in each."""

    nodes: tuple[tuple[int, ...], ...]
    same_settings: bool
    """Whether every member has the same arena size (else no member uses shared memory)."""

    @classmethod
    def parse(cls, records: np.ndarray) -> Topology:
        """From every member's `describe` record, (size, RECORD_BYTES), in group rank order."""
        by_host: dict[bytes, list[int]] = {}
        for rank, rec in enumerate(records):
            by_host.setdefault(bytes(rec[:HOST_BYTES]), []).append(rank)
        arenas = {bytes(rec[HOST_BYTES:]) for rec in records}
        return cls(tuple(tuple(ranks) for ranks in by_host.values()), len(arenas) == 1)

    @property
    def per_node(self) -> int:
        """Members on each node if every node has as many (else 0)."""
        sizes = {len(node) for node in self.nodes}
        return sizes.pop() if len(sizes) == 1 else 0

    def node_of(self, rank: int) -> tuple[int, ...]:
        return next(node for node in self.nodes if rank in node)

    def counterparts(self, rank: int) -> tuple[int, ...]:
        """The members with `rank`'s index on every node (one per node, in node order); needs `per_node`."""
        index = self.node_of(rank).index(rank)
        return tuple(node[index] for node in self.nodes)
