"""The two-level path: large ops of a group spread over hosts, within each host's arena and then across
(`hierarchy.two_level`)."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends.tcp.hierarchy import two_level
from axond.distributed.backends.tcp.hierarchy.two_level import Levels
from axond.distributed.backends.tcp.paths.base import DataPath
from axond.distributed.backends.tcp.policy import Path
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp


class TwoLevelPath(DataPath):
    """Ops in two levels over `levels` (each host's members, then one member per host)."""

    kind = Path.TWO_LEVEL

    def __init__(self, comm: GroupView, levels: Levels) -> None:
        super().__init__(comm)
        self.levels = levels

    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        two_level.all_reduce(self.levels, c, x, op)

    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        two_level.broadcast(self.levels, c, x, src)

    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        two_level.all_gather(self.levels, c, out)

    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        two_level.reduce_scatter(self.levels, c, src, out, op)
