"""The sockets path: every op over the group's sockets, on the schedule `policy.socket_algorithm` picks."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends.tcp.paths.base import DataPath
from axond.distributed.backends.tcp.policy import Path
from axond.distributed.backends.tcp.schedules import sockets
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp


class SocketsPath(DataPath):
    """Ops over the sockets: between hosts, and wherever no shared memory is mapped."""

    kind = Path.SOCKETS

    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        sockets.all_reduce(self.comm, c, x, op)

    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        sockets.broadcast(self.comm, c, x, src)

    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        sockets.all_gather(self.comm, c, out)

    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        sockets.reduce_scatter(self.comm, c, src, out, op)
