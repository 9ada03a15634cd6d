"""The single-copy path: large ops of a group on one host read the peers' buffers directly (`shm.single_copy_ops`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.paths.base import DataPath, MakeCall, own_row
from axond.distributed.backends.tcp.policy import Path, Shape
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm import single_copy_ops
from axond.distributed.backends.tcp.shm.single_copy import SingleCopy
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.ops import Op
from axond.distributed.numerics.reduce_op import ReduceOp


class SingleCopyPath(DataPath):
    """Ops on the single-copy path; broadcasts and all_gathers of the sizes `policy.compiled_single_copy` names are
    prepared in their compiled form."""

    kind = Path.SINGLE_COPY

    def __init__(self, comm: GroupView, sc: SingleCopy, shape: Callable[[], Shape]) -> None:
        super().__init__(comm)
        self.sc = sc
        self.shape = shape
        """The group's `Shape` as its placement knows it now."""

    @property
    def prepares_through(self) -> Any:
        return self.sc.sync.mailbox

    def takes(self, op: int, nbytes: int) -> bool:
        """Sizes that take this path only in its compiled form (`policy.needs_compiled`) need every member's."""
        return bool(self.sc.compiled) or not policy.needs_compiled(Op(op), nbytes, self.shape(), self.comm.options)

    def _compiled(self, op: Op, nbytes: int) -> bool:
        return bool(self.sc.compiled) and policy.compiled_single_copy(op, nbytes, self.shape(), self.comm.options)

    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        single_copy_ops.all_reduce(self.sc, c, x, op)

    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        single_copy_ops.broadcast(self.sc, c, x, src)

    def all_gather(self, c: Call, out: np.ndarray, x: np.ndarray) -> None:
        """The peers read x itself where they can (64 MiB of output on two ranks: 0.54-0.59x the time of reading the
        row this rank had just written; docs/design/tuning.md), while this rank copies it into its row."""
        if x.flags.c_contiguous and not np.may_share_memory(x, out):
            single_copy_ops.all_gather(self.sc, c, out, x)
        else:
            own_row(out, x, self.comm.rank)
            single_copy_ops.all_gather(self.sc, c, out)

    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        single_copy_ops.all_gather(self.sc, c, out)

    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        single_copy_ops.reduce_scatter(self.sc, c, src, out, op)

    def prepare_broadcast(self, c: Call, x: np.ndarray, src: int, make_call: MakeCall) -> Any:
        if not self._compiled(Op.BROADCAST, x.nbytes):
            return None
        return single_copy_ops.PreparedBroadcast(self.sc, c, x, src, make_call)

    def prepare_all_gather(self, c: Call, x: np.ndarray, make_call: MakeCall) -> Any:
        if not self._compiled(Op.ALL_GATHER, x.nbytes):
            return None
        return single_copy_ops.PreparedAllGather(self.sc, c, x, make_call)
