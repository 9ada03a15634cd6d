"""Collectives of a group spread over hosts, in two levels (see `placement`): through each host's shared-memory
arena, and between hosts over the sockets.

`local` is this member's host (its members in rank order, sharing `arena`), `across` this member and its
counterparts: the members with the same index on every host, in host order. A member's place is (host j,
index i); `hosts[j][i]` is its group rank. Each op runs one level after the other, composing the one-level
schedules: the sockets between hosts carry each byte once per host, split over the members' connections, and
the rest moves through the host's shared memory.

On hosts of different sizes (`Levels.even` False) there are no counterparts: `across` is the hosts' first members
(their leaders, in host order; None on the others), and all_reduce and broadcast go through them: all_reduce
reduces on each host, all-reduces between the leaders, and broadcasts on each host from its leader; broadcast
reaches the source's leader, then the other leaders, then each host's members. A host of one member has no arena
and skips its host steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from axond.distributed.backends.host_copy import copy
from axond.distributed.backends.tcp.policy import TWO_LEVEL_STEP_BYTES as STEP
from axond.distributed.backends.tcp.schedules import sockets
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm import arena_ops
from axond.distributed.backends.tcp.shm.arena import ShmArena
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import finish_average

Hosts = tuple[tuple[int, ...], ...]
BYTES = np.dtype(np.uint8)


@dataclass(eq=False)
class Levels:
    """The two levels of one member of a group spread over hosts."""

    local: GroupView
    across: GroupView | None
    """This member's counterparts (with `even`), or the hosts' leaders if this member is its host's (else None)."""
    arena: ShmArena | None
    """This host's arena, mapped by every member of every host (None on a host of one member)."""
    hosts: Hosts
    even: bool = True
    """Whether every host has as many members."""

    def __post_init__(self) -> None:
        self.sync = arena_ops.Sync(self.local, None)
        """A host's steps synchronize over its sockets (the mailbox is for groups on one host)."""

    @property
    def total(self) -> int:
        return sum(len(host) for host in self.hosts)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


def all_reduce(lv: Levels, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """x (flat, contiguous) <- the reduction over the group: each member reduces its part of every chunk on the host,
    all-reduces it with its counterparts, and the host copies the results out (see `arena_ops.all_reduce`)."""
    if not lv.even:
        _leader_all_reduce(lv, c, x, op)
        return
    assert lv.arena is not None and lv.across is not None
    arena_ops.all_reduce(lv.local, lv.arena, lv.sync, c, x, op, lv.across, lv.total, STEP)


def broadcast(lv: Levels, c: Call, x: np.ndarray, src: int) -> None:
    """x (flat, contiguous) <- group rank `src`'s: first to its counterparts over the sockets, then on every host
    from the member with src's index through the arena."""
    j_src = next(j for j, host in enumerate(lv.hosts) if src in host)
    i_src = lv.hosts[j_src].index(src)
    if not lv.even:
        _leader_broadcast(lv, c, x, j_src, i_src)
        return
    assert lv.arena is not None and lv.across is not None
    if lv.local.rank == i_src:
        sockets.broadcast(lv.across, c, x, j_src)
    arena_ops.broadcast(lv.local, lv.arena, lv.sync, c, x, i_src, STEP)


def _leader_all_reduce(lv: Levels, c: Call, x: np.ndarray, op: ReduceOp) -> None:
    """Hosts of different sizes: the host's reduction (in rank order), then between the leaders, then from each
    leader to its host. Every member ends with the leaders' bits."""
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op
    if lv.arena is not None:
        arena_ops.all_reduce(lv.local, lv.arena, lv.sync, c, x, inner, step=STEP)
    if lv.across is not None:
        sockets.all_reduce(lv.across, c, x, inner)
        if op is ReduceOp.AVG:
            finish_average(x, lv.total)
    if lv.arena is not None:
        arena_ops.broadcast(lv.local, lv.arena, lv.sync, c, x, 0, STEP)


def _leader_broadcast(lv: Levels, c: Call, x: np.ndarray, j_src: int, i_src: int) -> None:
    """Hosts of different sizes, source member `i_src` of host `j_src`: to that host's leader (through its arena,
    which reaches the whole host), between the leaders, then from each other leader to its host. A source that
    leads its host sends to the other leaders first."""
    home = lv.local.members == lv.hosts[j_src]
    if home and i_src != 0 and lv.arena is not None:
        arena_ops.broadcast(lv.local, lv.arena, lv.sync, c, x, i_src, STEP)
    if lv.across is not None:
        sockets.broadcast(lv.across, c, x, j_src)
    if (not home or i_src == 0) and lv.arena is not None:
        arena_ops.broadcast(lv.local, lv.arena, lv.sync, c, x, 0, STEP)


def _order(hosts: Hosts) -> np.ndarray:
    """Group rank of row (i, j) of a (per host, hosts) layout: member i of host j."""
    return np.array(hosts, np.intp).T.reshape(-1)


def all_gather(lv: Levels, c: Call, out: np.ndarray) -> None:
    """out (size, ...) <- every member's row; out[rank] already holds this member's.

    Across the hosts, this member gathers the rows of its counterparts; on its host, the members swap what
    they gathered through the arena. Where hosts hold consecutive ranks, or ranks round robin, each member's rows
    lie a fixed stride apart in `out`, and both levels move them in place (`_member_rows`); otherwise through
    scratch, and one copy puts the rows in group rank order.
    """
    assert lv.even and lv.across is not None and lv.arena is not None
    k, per_host = lv.across.size, lv.local.size
    rows = out.reshape(out.shape[0], -1).view(np.uint8)
    width = rows.shape[1]
    placed = _member_rows(rows, lv.hosts)
    fits = k <= lv.arena.chunk  # a step moves at least one column of each of the k rows
    flat = k == 2 or (placed is not None and placed[lv.local.rank].flags.c_contiguous)  # the ring and doubling need it
    if placed is not None and fits and flat:
        sockets.all_gather(lv.across, c, placed[lv.local.rank])
        arena_ops.all_gather(lv.local, lv.arena, lv.sync, c, placed, STEP)
        return
    staged = lv.local.scratch.named("two_level", per_host * k * width, BYTES, per_host * k * width)
    staged = staged.reshape(per_host, k, width)
    me = staged[lv.local.rank]
    copy(me[lv.across.rank], rows[lv.hosts[lv.across.rank][lv.local.rank]])
    sockets.all_gather(lv.across, c, me)
    arena_ops.all_gather(lv.local, lv.arena, lv.sync, c, staged, STEP)
    rows[_order(lv.hosts)] = staged.reshape(per_host * k, width)


def _member_rows(rows: np.ndarray, hosts: Hosts) -> np.ndarray | None:
    """A (per host, hosts, width) view of `rows` (group rank order) whose [i, j] is member i of host j's row, if
    the hosts hold consecutive ranks or ranks round robin; else None."""
    k, per_host = len(hosts), len(hosts[0])
    layout = _layout(hosts)
    if layout == "consecutive":
        return rows.reshape(k, per_host, -1).transpose(1, 0, 2)
    if layout == "round robin":
        return rows.reshape(per_host, k, -1)
    return None


@functools.lru_cache(maxsize=64)
def _layout(hosts: Hosts) -> str | None:
    """How the hosts hold the group's ranks: "consecutive", "round robin" or neither (None); worked out once per
    layout, not at every op."""
    k, per_host = len(hosts), len(hosts[0])
    if all(hosts[j][i] == j * per_host + i for j in range(k) for i in range(per_host)):
        return "consecutive"
    if all(hosts[j][i] == i * k + j for j in range(k) for i in range(per_host)):
        return "round robin"
    return None


def reduce_scatter(lv: Levels, c: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out (flat) <- block `rank` of the reduction of every member's src (flat, size blocks).

    The host reduces its input as if its blocks were laid out so that row i holds the blocks of every host's
    member i (straight from `src` into the arena, no copy so laid out): member i gets row i reduced over the
    host, and then reduce-scatters those k blocks with its counterparts over the sockets.
    """
    assert lv.even and lv.across is not None and lv.arena is not None
    k, block = lv.across.size, out.size
    summed = lv.local.scratch.named("two_level_sum", k * block * src.itemsize, src.dtype, k * block)
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op
    arena_ops.reduce_scatter(lv.local, lv.arena, lv.sync, c, src, summed, inner, _order(lv.hosts), STEP)
    sockets.reduce_scatter(lv.across, c, summed, out, inner)
    if op is ReduceOp.AVG:
        finish_average(out, lv.total)
