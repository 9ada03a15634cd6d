"""broadcast, all_gather and reduce_scatter of a group spread over nodes, in two levels (see `shm_plan`).

`local` is this member's node (its members in rank order, sharing an arena), `across` this member and
its counterparts: the members with the same index on every node, in node order. A member's place is
(node j, index i); `nodes[j][i]` is its group rank. Each op runs one level after the other: the
sockets between nodes carry each byte once per node, split over the members' connections, and the
rest moves through the node's shared memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.framing import Call
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import finish_average
from axond.distributed.shm import ShmArena
from axond.distributed.team import Team

Nodes = tuple[tuple[int, ...], ...]
Buffer = Callable[[str, int, np.dtype, int], np.ndarray]
"""The group's cached scratch buffers: (name, nbytes, dtype, count) -> a flat array of `count`."""


def _arena(local: Team) -> ShmArena:
    assert local._arena is not None  # teams are only handed out with their node's arena mapped
    return local._arena


def broadcast(c: Call, local: Team, across: Team, nodes: Nodes, src: int, x: np.ndarray) -> None:
    """x (flat, contiguous) <- group rank `src`'s: first to its counterparts over the sockets, then on every node
    from the member with src's index through the arena."""
    j_src = next(j for j, node in enumerate(nodes) if src in node)
    i_src = nodes[j_src].index(src)
    if local.rank == i_src:
        across._broadcast_flat(c, x, j_src)
    local._shm_broadcast(c, _arena(local), x, i_src)


def _order(nodes: Nodes) -> np.ndarray:
    """Group rank of row (i, j) of a (per node, nodes) layout: member i of node j."""
    return np.array(nodes, np.intp).T.reshape(-1)


def all_gather(c: Call, local: Team, across: Team, nodes: Nodes, out: np.ndarray, buffer: Buffer) -> None:
    """out (size, ...) <- every member's row; out[rank] already holds this member's.

    Across the nodes, this member gathers the rows of its counterparts; on its node, the members swap what
    they gathered through the arena; then one copy puts the rows in group rank order.
    """
    k, per_node = len(nodes), local.size
    rows = out.reshape(out.shape[0], -1).view(np.uint8)
    width = rows.shape[1]
    staged = buffer("two_level", per_node * k * width, np.dtype(np.uint8), per_node * k * width)
    staged = staged.reshape(per_node, k, width)
    me = staged[local.rank]
    np.copyto(me[across.rank], rows[local.members[local.rank]])
    across._all_gather_flat(c, me)
    local._shm_all_gather(c, _arena(local), staged)
    rows[_order(nodes)] = staged.reshape(per_node * k, width)


def reduce_scatter(c: Call, local: Team, across: Team, nodes: Nodes, src: np.ndarray, out: np.ndarray,
                   op: ReduceOp, total: int, buffer: Buffer) -> None:
    """out (flat) <- block `rank` of the reduction of every member's src (flat, size blocks).

    The blocks are first laid out so that member i's node holds, in row i, the blocks of every node's
    member i; the node reduces row i into member i (through the arena), which then reduce-scatters those
    k blocks with its counterparts over the sockets.
    """
    k, per_node = len(nodes), local.size
    block = out.size
    laid = buffer("two_level", src.nbytes, src.dtype, src.size).reshape(per_node * k, block)
    np.take(src.reshape(-1, block), _order(nodes), axis=0, out=laid)
    summed = buffer("two_level_sum", k * block * src.itemsize, src.dtype, k * block)
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op
    local._shm_reduce_scatter(c, _arena(local), laid.reshape(-1), summed, inner)
    across._reduce_scatter_flat(c, summed, out, inner)
    if op is ReduceOp.AVG:
        finish_average(out, total)
