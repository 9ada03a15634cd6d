"""Ranks of one host that the scheduler left on one core are moved apart once, when their mailbox is mapped.

Two processes started together often begin on the same core, and while they spin on the mailbox (yielding) the
kernel's balancer may leave them there for seconds: every small op then waits for a time slice, an 8-byte
all_reduce on two ranks took 43-44 us instead of 3 (bench/RESULTS.md, session 17). So when a one-host group maps
its mailbox, every member tells the others the core it is on (over the sockets); members that share a core with a
member of lower rank move themselves, in rank order, to cores of their affinity mask that no member is on, by
narrowing the mask to that core and setting it back at once (so the kernel migrates the thread, and nothing stays
pinned). Members whose mask has no such core stay where they are. With AXOND_DEBUG=1 a moved rank says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import numpy as np

from axond.distributed import failure
from axond.distributed.backends.tcp.schedules import direct
from axond.distributed.backends.tcp.schedules.comm import Comm
from axond.distributed.backends.tcp.transport.framing import Call


def _getcpu() -> object:
    try:
        return ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):  # pragma: no cover - not glibc/Linux
        return None


_SCHED_GETCPU = _getcpu()


def current_cpu() -> int:
    """The core the calling thread runs on (-1 if unknown)."""
    if _SCHED_GETCPU is None:  # pragma: no cover
        return -1
    return int(_SCHED_GETCPU())  # type: ignore[operator]


def plan(cpus: list[int], allowed: list[set[int]]) -> dict[int, int]:
    """{rank: core} for the members to move: each one on the core of a member of lower rank (or on no known core)
    goes, in rank order, to the lowest core of its own `allowed` set that no member is on or was given."""
    taken: set[int] = set()
    movers: list[int] = []
    for rank, cpu in enumerate(cpus):
        if cpu < 0 or cpu in taken:
            movers.append(rank)
        else:
            taken.add(cpu)
    moves: dict[int, int] = {}
    for rank in movers:
        free = sorted(allowed[rank] - taken)
        if free:
            moves[rank] = free[0]
            taken.add(free[0])
    return moves


def spread(comm: Comm, c: Call) -> int | None:
    """Move this member off a core it shares with a member of lower rank (see the module); the core it moved to."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        allowed = set()
    table = np.full((comm.size, 1 + 64), -1, np.int64)  # this member's core, then its allowed cores (up to 64)
    table[comm.rank, 0] = current_cpu()
    mask = sorted(allowed)[:64]
    table[comm.rank, 1 : 1 + len(mask)] = mask
    direct.direct_all_gather(comm, c, table)  # every member takes part, even one that cannot move (a pinned rank)
    if len(allowed) < 2:
        return None
    moves = plan([int(v) for v in table[:, 0]], [{int(v) for v in row[1:] if v >= 0} for row in table])
    target = moves.get(comm.rank)
    if target is None:
        return None
    try:
        os.sched_setaffinity(0, {target})  # the kernel migrates the thread now
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):  # a mask this thread had a moment ago: never refused in practice
            os.sched_setaffinity(0, allowed)  # and it stays there unpinned
    if failure.debug():
        print(f"axond: {comm.g.where('set-up')}: moved from core {table[comm.rank, 0]}, shared with another rank of the "
              f"group, to core {target}", file=sys.stderr, flush=True)
    return target
