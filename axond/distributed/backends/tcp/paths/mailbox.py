"""The mailbox path: small ops of a group on one host, each member's payload in its slot (`shm.mailbox_ops`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from axond.distributed.backends.tcp.paths.base import DataPath, MakeCall
from axond.distributed.backends.tcp.policy import Path
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm import mailbox_ops
from axond.distributed.backends.tcp.shm.mailbox import Mailbox
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp


class MailboxPath(DataPath):
    """Ops through the group's mailbox; each op's first call of a shape leaves a prepared form behind."""

    kind = Path.MAILBOX

    def __init__(self, comm: GroupView, box: Mailbox) -> None:
        super().__init__(comm)
        self.box = box

    @property
    def prepares_through(self) -> Mailbox:
        return self.box

    def all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp) -> None:
        mailbox_ops.all_reduce(self.box, c, x, op)

    def broadcast(self, c: Call, x: np.ndarray, src: int) -> None:
        mailbox_ops.broadcast(self.box, c, x, src)

    def gather_rows(self, c: Call, out: np.ndarray) -> None:
        mailbox_ops.all_gather(self.box, c, out)

    def reduce_scatter(self, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        mailbox_ops.reduce_scatter(self.box, c, src, out, op)

    def barrier(self, c: Call) -> None:
        mailbox_ops.barrier(self.box, c)

    def prepare_all_reduce(self, c: Call, x: np.ndarray, op: ReduceOp, make_call: MakeCall) -> Any:
        return mailbox_ops.SmallAllReduce(self.box, c, x, op, make_call)

    def prepare_broadcast(self, c: Call, x: np.ndarray, src: int, make_call: MakeCall) -> Any:
        return mailbox_ops.prepared_broadcast(self.box, c, x.nbytes, src, make_call)

    def prepare_all_gather(self, c: Call, x: np.ndarray, make_call: MakeCall) -> Any:
        return mailbox_ops.SmallAllGather(self.box, c, x, make_call)

    def prepare_reduce_scatter(self, c: Call, src: np.ndarray, per: int, op: ReduceOp, make_call: MakeCall) -> Any:
        return mailbox_ops.SmallReduceScatter(self.box, c, src, per, op, make_call)

    def prepare_barrier(self, c: Call, make_call: MakeCall) -> Any:
        return mailbox_ops.SmallBarrier(self.box, c, make_call)
