"""Where a tcp group's members are and what shared memory they mapped, learned and decided by every member together.

At the group's first op that could use shared memory (`policy.candidates` lists a shared-memory path while the
hosts are unknown) the members exchange their addresses (the same address: the same host) and arena sizes over
the sockets, so each derives the same `Topology`. Then:

- Every member on one host: a mailbox for small ops and, for large ones, the single-copy path (set up at the
  first op that takes it, if every member can read the others' memory) or else an arena, each mapped at the first
  op that takes it (the arena's steps and the single-copy path's publications go through the mailbox). Sizes that
  take the single-copy path only in its compiled form (`policy.needs_compiled`) take the mailbox unless every
  member runs it.
- Spread over hosts with as many members on each (two or more): an arena per host, mapped at the first op large
  enough; from then on large ops run in two levels (`hierarchy.two_level`). On hosts of different sizes, one of
  them with two or more members, the same for all_reduce and broadcast, through each host's first member.
- Otherwise (one member per host, different arena sizes, or a member that cannot map its host's arena):
  everything on the sockets.

`choose` gives an op its path object (`paths`): the first of the policy's candidates whose memory every member
mapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.hierarchy.topology import RECORD_BYTES, Topology, describe
from axond.distributed.backends.tcp.hierarchy.two_level import Levels
from axond.distributed.backends.tcp.paths import (
    ArenaPath, DataPath, MailboxPath, SingleCopyPath, SocketsPath, TwoLevelPath,
)
from axond.distributed.backends.tcp.policy import Path, Shape
from axond.distributed.backends.tcp.schedules import direct
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm.arena import SLOT_SHIFT, ShmArena
from axond.distributed.backends.tcp.shm.arena_ops import Sync
from axond.distributed.backends.tcp.shm.mailbox import Mailbox
from axond.distributed.backends.tcp.shm.mailbox import arena_bytes as mailbox_bytes
from axond.distributed.backends.tcp.shm.setup import agree, map_arena
from axond.distributed.backends.tcp.shm.single_copy import SingleCopy
from axond.distributed.backends.tcp.shm.single_copy import set_up as set_up_single_copy
from axond.distributed.backends.tcp.shm.spread import spread
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.backends.tcp.transport.wire import OP_NAMES, Op

CACHED_ROUTES = 256
"""(op, size) pairs whose candidate paths are kept (a training loop asks for the same few every step)."""


class Placement:
    """One member's view of its group's hosts and shared memory."""

    def __init__(self, comm: GroupView, host: str) -> None:
        self.comm = comm
        self.host = host
        """The address this member advertises to its peers: members advertising the same one share a host."""
        self.topology: Topology | None = None
        """The group's hosts once learned (None before, or if the members' shared-memory settings differ)."""
        self.known = comm.size == 1
        self.shape = Shape(comm.size, comm.oversubscribed, hosts=1 if self.known else None, per_host=comm.size)
        self.mailbox: Mailbox | None = None
        self.mailbox_tried = False
        self.single_copy: SingleCopy | None = None
        """The single-copy path of a group on one host, once every member found it works."""
        self.single_copy_tried = False
        self.arena: ShmArena | None = None
        """The arena of a group on one host, once mapped."""
        self.levels: Levels | None = None
        """The two levels of a group spread over hosts, once its hosts' arenas are mapped."""
        self.arena_tried = False
        """Whether the arena (one host) or the hosts' arenas (several) were set up, or tried."""
        self.sync = Sync(comm, None)
        """How the steps of the one-host arena synchronize (through the mailbox once it is mapped)."""
        self._paths: dict[tuple[Op, int], tuple[Path, ...]] = {}
        """Candidate paths by (op, bytes per rank), as `policy.candidates` lists them."""
        self.sockets = SocketsPath(comm)
        self._objects: dict[Path, tuple[Any, DataPath]] = {}
        """The path object of each kind, with what it runs on."""
        self._builders: dict[Path, Callable[[Call], DataPath | None]] = {
            Path.MAILBOX: self._mailbox_path, Path.SINGLE_COPY: self._single_copy_path, Path.ARENA: self._arena_path,
            Path.TWO_LEVEL: self._two_level_path, Path.SOCKETS: self._sockets_path,
        }
        """Each kind's path object, set up with every member at the first op that takes it (None: a member could
        not)."""

    def choose(self, c: Call, op: Op, nbytes: int) -> DataPath:
        """The path object op `op` on `nbytes` per rank (call `c`) runs on: the first of the policy's candidates that
        every member set up and that takes it, else the sockets. Learns the hosts or maps memory the first time an op
        needs it."""
        kinds = self._paths.get((op, nbytes))
        if kinds is None:
            kinds = policy.candidates(op, nbytes, self.shape, self.comm.options)
            if len(kinds) > 1 and not self.known:
                self._learn(c)
                kinds = policy.candidates(op, nbytes, self.shape, self.comm.options)
            if len(self._paths) >= CACHED_ROUTES:
                self._paths.clear()
            self._paths[(op, nbytes)] = kinds
        for kind in kinds:
            path = self._builders[kind](c)
            if path is not None and path.takes(op, nbytes):
                return path
        return self.sockets

    def _wrap(self, kind: Path, on: Any, make: Callable[[Any], DataPath]) -> DataPath | None:
        """The path object of `kind` running on `on` (the mailbox, `SingleCopy`, arena or `Levels` this member
        mapped; None: not mapped, no path), made once per mapping."""
        if on is None:
            return None
        known = self._objects.get(kind)
        if known is not None and known[0] is on:
            return known[1]
        path = make(on)
        self._objects[kind] = (on, path)
        return path

    def _mailbox_path(self, c: Call) -> DataPath | None:
        box = self.mailbox if self.mailbox_tried else self._map_mailbox(c)
        return self._wrap(Path.MAILBOX, box, lambda on: MailboxPath(self.comm, on))

    def _single_copy_path(self, c: Call) -> DataPath | None:
        single = self.single_copy if self.single_copy_tried else self._set_up_single_copy(c)
        return self._wrap(Path.SINGLE_COPY, single, lambda on: SingleCopyPath(self.comm, on, lambda: self.shape))

    def _arena_path(self, c: Call) -> DataPath | None:
        arena = self.arena if self.arena_tried else self._map_arena(c)
        return self._wrap(Path.ARENA, arena, lambda on: ArenaPath(self.comm, on, self.sync))

    def _two_level_path(self, c: Call) -> DataPath | None:
        levels = self.levels if self.arena_tried else self._map_levels(c)
        return self._wrap(Path.TWO_LEVEL, levels, lambda on: TwoLevelPath(self.comm, on))

    def _sockets_path(self, c: Call) -> DataPath:
        return self.sockets

    def _learn(self, c: Call) -> None:
        """Every member's address and arena size, gathered over the sockets: the same topology everywhere."""
        records = np.zeros((self.comm.size, RECORD_BYTES), np.uint8)
        records[self.comm.rank] = describe(self.host, self.comm.options.shm_arena_bytes)
        self.comm.g.run(OP_NAMES[c.op], direct.direct_all_gather, self.comm, c, records)
        topology = Topology.parse(records)
        self.known, self._paths = True, {}
        if not topology.same_settings:
            self.shape = Shape(self.comm.size, self.comm.oversubscribed, hosts=0)
            return
        self.topology = topology
        self.shape = Shape(self.comm.size, self.comm.oversubscribed, hosts=len(topology.nodes),
                           per_host=topology.per_node, largest_host=max(len(node) for node in topology.nodes))

    def _map_mailbox(self, c: Call) -> Mailbox | None:
        self.mailbox_tried = True
        size = self.comm.size
        arena = self.comm.g.run(OP_NAMES[c.op], map_arena, self.comm, c, mailbox_bytes(size))
        if arena is not None:
            self.mailbox = self.sync.mailbox = Mailbox(arena, self.comm.rank, size, self.comm.g,
                                                       native=self.comm.options.shm_native,
                                                       oversubscribed=self.comm.oversubscribed,
                                                       poll=policy.mailbox_poll_seconds(self.comm.options,
                                                                                        self.comm.oversubscribed))
            self.comm.g.watch(self.mailbox.watch)
            # members spinning on one core: move apart
            self.mailbox.home = self.comm.g.run(OP_NAMES[c.op], spread, self.comm, c)
        return self.mailbox

    def _set_up_single_copy(self, c: Call) -> SingleCopy | None:
        self.single_copy_tried = True
        if not self.mailbox_tried and policy.spins(self.comm.options, self.shape):
            self._map_mailbox(c)  # publications and synchronizations go through it
        self.single_copy = self.comm.g.run(OP_NAMES[c.op], set_up_single_copy, self.comm, self.sync, c)
        return self.single_copy

    def _map_arena(self, c: Call) -> ShmArena | None:
        self.arena_tried = True
        self.arena = self.comm.g.run(OP_NAMES[c.op], map_arena, self.comm, c, self.comm.options.shm_arena_bytes,
                                     SLOT_SHIFT)
        if self.arena is not None and not self.mailbox_tried and policy.spins(self.comm.options, self.shape):
            self._map_mailbox(c)  # the arena's steps synchronize through it
        return self.arena

    def _map_levels(self, c: Call) -> Levels | None:
        self.arena_tried = True
        self.levels = self.comm.g.run(OP_NAMES[c.op], self._two_levels, c)
        return self.levels

    def _two_levels(self, c: Call) -> Levels | None:
        """Map this host's arena; every member of every host must have mapped its own, or none is used."""
        topology, comm = self.topology, self.comm
        assert topology is not None
        local = comm.subset(topology.node_of(comm.rank))
        even = topology.per_node > 0
        if even:
            across: GroupView | None = comm.subset(topology.counterparts(comm.rank))
        else:  # hosts of different sizes: only each host's first member works across
            leaders = tuple(node[0] for node in topology.nodes)
            across = comm.subset(leaders) if comm.rank in leaders else None
        arena = map_arena(local, c, comm.options.shm_arena_bytes, SLOT_SHIFT) if local.size > 1 else None
        try:
            mapped = agree(comm, c, arena is not None or local.size == 1)
        except BaseException:
            if arena is not None:
                arena.close()
            raise
        if not mapped:
            if arena is not None:
                arena.close()
            return None
        return Levels(local, across, arena, topology.nodes, even)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.levels is not None:
            self.levels.close()
        if self.mailbox is not None:
            self.mailbox.close()
        self.arena, self.levels, self.mailbox, self.single_copy = None, None, None, None
        self.arena_tried = self.mailbox_tried = self.single_copy_tried = True
        self._objects.clear()
