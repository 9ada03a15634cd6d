"""How a tcp group uses shared memory, decided by every member together.

At the group's first op that could use shared memory the members exchange their addresses (the same
address: the same node) and arena sizes over the sockets, so each derives the same `Topology`. Then:

- Every member on one node: a mailbox for small ops (`mailbox`) and an arena for large all_reduce,
  broadcast, all_gather and reduce_scatter (`ShmAlgorithms`), each mapped at the first op that uses it.
- Spread over nodes with as many members on each (two or more): an arena per node, mapped at the first
  op large enough. From then on large all_reduce (`ShmAlgorithms._shm_all_reduce` with `across`),
  broadcast, all_gather and reduce_scatter (`two_level`) run in two levels: through the node's arena,
  and with the counterparts on the other nodes over the sockets.
- Otherwise (one member per node, nodes of different sizes, different arena sizes, or a member that
  cannot map its node's arena): everything on the sockets.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.framing import Call, FramedGroup, TcpTuning
from axond.distributed.mailbox import MAILBOX_BYTES, ORDERED_STORES, Mailbox
from axond.distributed.mailbox import arena_bytes as mailbox_bytes
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.shm import ShmArena, ShmTuning
from axond.distributed.team import Team
from axond.distributed.topology import RECORD_BYTES, Topology, describe
from axond.distributed.wire import OP_NAMES


class ShmPlan:
    """Mixed into `TcpBackend`: the lazy, collective decision above and its result."""

    g: FramedGroup
    rank: int
    size: int
    tuning: TcpTuning
    crowded: bool
    shm: ShmTuning
    host: str
    """The address this member advertises to its peers: members advertising the same one share a node."""
    _arena: ShmArena | None
    _arena_tried: bool
    """Whether the arena (one node) or the node arenas (several) were set up, or tried."""
    _topology: Topology | None
    _topology_known: bool
    _mailbox: Mailbox | None
    _mailbox_tried: bool
    _teams: tuple[Team, Team] | None
    """Hierarchical groups: (this node's members, this member and its counterparts on the other nodes)."""

    _direct_all_gather: Callable[[Call, np.ndarray], None]
    _recursive_doubling: Callable[[Call, np.ndarray, ReduceOp], None]
    _make_arena: Callable[[Call, int], ShmArena | None]
    _watch_mailbox: Callable[[Call], None]
    _shm_min_bytes: Callable[[bool], int]
    _scratch: Callable[[int, np.dtype, int], np.ndarray]
    _rolling: Callable[[int, np.dtype], np.ndarray]

    def _large(self, nbytes: int, scale: int, spin: bool = False) -> bool:
        """Whether an op on `nbytes` reaches `scale` times the threshold (`spin`: of an arena synchronized through the
        mailbox), and shared memory is on at all; empty ops stay on the sockets, where their frames are still
        checked."""
        return self.size > 1 and self.shm.enabled and nbytes >= max(1, scale * self._shm_min_bytes(spin))

    def _spins(self) -> bool:
        """Whether the group's arena, if it has one, synchronizes its steps through the mailbox (see
        `TcpBackend._sync`): the mailbox is mapped with it wherever it can be."""
        return self.shm.mailbox and ORDERED_STORES

    def _nodes(self, c: Call) -> Topology | None:
        """The group's topology, gathered at its first op that could use shared memory (None: the members' arena
        sizes differ)."""
        if not self._topology_known:
            self._topology_known = True
            self._topology = self.g.run(OP_NAMES[c.op], self._gather_topology, c)
        return self._topology

    def _gather_topology(self, c: Call) -> Topology | None:
        """Every member's address and arena size, gathered over the sockets: the same topology everywhere."""
        records = np.zeros((self.size, RECORD_BYTES), np.uint8)
        records[self.rank] = describe(self.host, self.shm.arena_bytes)
        self._direct_all_gather(c, records)
        topology = Topology.parse(records)
        return topology if topology.same_settings else None

    def _use_mailbox(self, c: Call, nbytes: int) -> Mailbox | None:
        """The group's mailbox (see `mailbox`), if an op with `nbytes` of payload per rank (1..MAILBOX_BYTES; 0 for
        a barrier) should go through it: groups on one node, on x86. Mapped at the group's first such op."""
        if self.size == 1 or not (self.shm.enabled and self.shm.mailbox and ORDERED_STORES) or nbytes > MAILBOX_BYTES:
            return None
        if not self._mailbox_tried:
            topology = self._nodes(c)
            if topology is None or len(topology.nodes) > 1:
                return None
            self._mailbox_tried = True
            arena = self.g.run(OP_NAMES[c.op], self._make_arena, c, mailbox_bytes(self.size))
            self._mailbox = Mailbox(arena, self.rank, self.size) if arena is not None else None
            if self._mailbox is not None:
                self.g.watch(self._watch_mailbox)
        return self._mailbox

    def _use_shm(self, c: Call, nbytes: int, scale: int = 1) -> ShmArena | None:
        """The group's arena, if an op on `nbytes` should go through it: from `scale` times the threshold (2 for an
        all_reduce that synchronizes twice per step, and for broadcast, whose socket path is one message per
        rank). Only groups on one node have one; mapped at the first such op, every member agrees or none uses it."""
        if not self._large(nbytes, scale, self._spins()):
            return None
        topology = self._nodes(c)
        if topology is None or len(topology.nodes) > 1:
            return None
        if not self._arena_tried:
            self._arena_tried = True
            self._arena = self.g.run(OP_NAMES[c.op], self._make_arena, c, 0)
            if self._arena is not None:
                self._use_mailbox(c, 0)  # its steps synchronize through the mailbox (see `_sync`)
        return self._arena

    def _use_hierarchy(self, c: Call, nbytes: int, scale: int = 0) -> tuple[Team, Team] | None:
        """(node team, team across nodes) if an op on `nbytes` should run in two levels: groups over several nodes
        with as many members (two or more) on each, from `scale` times the threshold (all_reduce, scale 0: once
        with two members per node, twice with more, as their node's steps synchronize twice)."""
        if not self._large(nbytes, 1):
            return None
        topology = self._nodes(c)
        if topology is None or len(topology.nodes) == 1 or topology.per_node < 2:
            return None
        if not self._large(nbytes, scale or (1 if topology.per_node == 2 else 2)):
            return None
        if not self._arena_tried:
            self._arena_tried = True
            self._teams = self.g.run(OP_NAMES[c.op], self._hierarchy, c, topology)
        return self._teams

    def _hierarchy(self, c: Call, topology: Topology) -> tuple[Team, Team] | None:
        """Map this node's arena; every member of every node must have mapped its own, or none is used."""
        local, across = (Team(self.g, self.rank, members, self.tuning, self.crowded, self.shm, self._scratch,
                              self._rolling)
                         for members in (topology.node_of(self.rank), topology.counterparts(self.rank)))
        local._arena = local._make_arena(c)
        mapped = np.array([local._arena is not None], np.uint8)
        try:
            self._recursive_doubling(c, mapped, ReduceOp.MIN)
        finally:
            if not mapped[0]:
                local.close()
        return (local, across) if mapped[0] else None
