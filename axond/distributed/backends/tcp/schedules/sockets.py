"""The collectives over a group's sockets: each picks its schedule with `policy.socket_algorithm` and runs it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.schedules import direct, doubling, ring, trees
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.backends.tcp.transport.wire import Op
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import finish_average

ALL_REDUCE: dict[str, Callable[[GroupView, Call, np.ndarray, ReduceOp], None]] = {
    "doubling": doubling.recursive_doubling, "halving_doubling": doubling.halving_doubling,
    "ring": ring.ring_all_reduce,
}
BROADCAST: dict[str, Callable[[GroupView, Call, np.ndarray, int], None]] = {
    "tree": trees.tree_broadcast, "chain": trees.chain_broadcast,
}
ALL_GATHER: dict[str, Callable[[GroupView, Call, np.ndarray], None]] = {
    "direct": direct.direct_all_gather, "exchange": direct.exchange_all_gather,
    "doubling": doubling.doubling_all_gather, "ring": ring.ring_all_gather_rows,
}
REDUCE_SCATTER: dict[str, Callable[[GroupView, Call, np.ndarray, np.ndarray, ReduceOp], None]] = {
    "direct": direct.direct_reduce_scatter, "halving": doubling.halving_reduce_scatter,
    "ring": ring.ring_reduce_scatter_into,
}


def _algorithm(comm: GroupView, op: Op, nbytes: int) -> str:
    return policy.socket_algorithm(op, nbytes, comm.size, comm.oversubscribed, comm.options)


def all_reduce(comm: GroupView, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """x (flat, contiguous) <- the reduction over the group."""
    if comm.size > 1:
        ALL_REDUCE[_algorithm(comm, Op.ALL_REDUCE, x.nbytes)](comm, c, x, op)


def broadcast(comm: GroupView, c: Call, x: np.ndarray, src: int) -> None:
    """x (flat, contiguous) <- rank `src`'s."""
    if comm.size > 1:
        BROADCAST[_algorithm(comm, Op.BROADCAST, x.nbytes)](comm, c, x, src)


def all_gather(comm: GroupView, c: Call, out: np.ndarray) -> None:
    """out (size, ...; contiguous) <- every rank's row; row `rank` is already in place."""
    if comm.size > 1:
        ALL_GATHER[_algorithm(comm, Op.ALL_GATHER, out.nbytes // comm.size)](comm, c, out)


def reduce_scatter(comm: GroupView, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out (flat) <- block `rank` of the reduction of flat `src` (size blocks)."""
    if comm.size == 1:
        np.copyto(out, src)
        if op is ReduceOp.AVG:
            finish_average(out, 1)
        return
    REDUCE_SCATTER[_algorithm(comm, Op.REDUCE_SCATTER, src.nbytes)](comm, c, src, out, op)
