"""Mapping a group's shared memory, decided by every member together: rank 0 creates the file and sends its name,
each member maps it, and a MIN over "mapped" decides whether anyone uses it."""

from __future__ import annotations

import numpy as np

from axond.distributed.backends.tcp.schedules import doubling, trees
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm.arena import NAME_BYTES, ShmArena, available, unlink
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp


def agree(comm: GroupView, c: Call, ok: bool) -> bool:
    """Whether every member says `ok` (a MIN over the group)."""
    flag = np.array([ok], np.uint8)
    doubling.recursive_doubling(comm, c, flag, ReduceOp.MIN)
    return bool(flag[0])


def map_arena(comm: GroupView, c: Call, nbytes: int, shift: int = 0) -> ShmArena | None:
    """An arena of `nbytes` (slots `shift` bytes into a page: `ShmArena`) mapped by every member of `comm`, or None
    for all if any member could not map it.

    Rank 0 unlinks the file once everyone has answered (or the set-up failed), so it never outlives
    the processes that map it.
    """
    arena: ShmArena | None = None
    name = np.zeros(NAME_BYTES, np.uint8)
    try:
        if comm.rank == 0 and available():
            try:
                arena = ShmArena.create(comm.size, nbytes, shift)
                name = arena.name()
            except OSError:
                arena = None
        trees.tree_broadcast(comm, c, name, 0)
        if comm.rank != 0 and name.any():
            try:
                arena = ShmArena.attach(name, comm.size, nbytes, shift)
            except (OSError, ValueError):
                arena = None
        mapped = agree(comm, c, arena is not None)
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    finally:
        if comm.rank == 0 and arena is not None:
            unlink(arena.path)
    if not mapped:
        if arena is not None:
            arena.close()
        return None
    return arena
