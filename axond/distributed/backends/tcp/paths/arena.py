"""The arena path: large ops of a group on one host, staged through its shared arena (`shm.arena_ops`)."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.paths.base import DataPath
from axond.distributed.backends.tcp.policy import Path
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm import arena_ops
from axond.distributed.backends.tcp.shm.arena import ShmArena
from axond.distributed.backends.tcp.shm.arena_ops import Sync
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.ops import Op
from axond.distributed.numerics.reduce_op import ReduceOp


class ArenaPath(DataPath):
    """Ops through the arena, their steps synchronized by `sync` (through the mailbox where it is mapped)."""

    kind = Path.ARENA

    def __init__(self, comm: GroupView, arena: ShmArena, sync: Sync) -> None:
        super().__init__(comm)
        self.arena, self.sync = arena, sync

    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        step = policy.arena_step(Op.ALL_REDUCE, x.nbytes, self.comm.size)
        arena_ops.all_reduce(self.comm, self.arena, self.sync, c, x, op, step=step)

    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        step = policy.arena_step(Op.BROADCAST, x.nbytes, self.comm.size)
        arena_ops.broadcast(self.comm, self.arena, self.sync, c, x, src, step)

    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        arena_ops.all_gather(self.comm, self.arena, self.sync, c, out)

    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        arena_ops.reduce_scatter(self.comm, self.arena, self.sync, c, src, out, op)
