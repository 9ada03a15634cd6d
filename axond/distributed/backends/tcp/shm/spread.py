"""Ranks of one host that the scheduler left on one core are moved apart once, when their mailbox is mapped.

Two processes started together often begin on the same core, and while they spin on the mailbox (yielding) the
kernel's balancer may leave them there for seconds: every small op then waits for a time slice, an 8-byte
all_reduce on two ranks took over ten times as long (docs/design/tuning.md#home-cores). So when a one-host group maps
its mailbox, every member tells the others the core it is on (over the sockets); members that share a core with a
member of lower rank move themselves, in rank order, to cores of their affinity mask that no member is on, by
narrowing the mask to that core and setting it back at once (so the kernel migrates the thread, and nothing stays
pinned). Members whose mask has no such core stay where they are. With AXOND_DEBUG=1 a moved rank says so.

With more members than cores the kernel also leaves them unevenly, three of four on one of two cores for the whole
run (each spins, so every core looks busy), which slows their ops as much (docs/design/tuning.md#home-cores). There
member r moves to core r mod cores (of the cores of
all their masks, where its own has it), the same way: two per core on 2 cores. That is the thread's home from then
on: its later groups (subgroups of the job, say) keep it and move nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import weakref

import numpy as np

from axond.distributed.diagnostics import failure
from axond.distributed.backends.tcp.schedules import direct
from axond.distributed.backends.tcp.schedules.group_view import GroupView
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


def home(rank: int, allowed: list[set[int]]) -> int | None:
    """Member `rank`'s core where the members outnumber the cores of all their masks (`allowed`, one per member): the
    (rank mod cores)-th of those cores if its own mask has it; else None (and where the cores suffice)."""
    cores = sorted(set().union(*allowed)) if allowed else []
    if not len(allowed) > len(cores) > 0:
        return None
    core = cores[rank % len(cores)]
    return core if core in allowed[rank] else None


def plan(cpus: list[int], allowed: list[set[int]]) -> dict[int, int]:
    """{rank: core} for the members to move. Where the cores of all their masks suffice, each member on the core of a
    member of lower rank (or on no known core) goes, in rank order, to the lowest core of its own `allowed` set that no
    member is on or was given. With more members than cores, each member not on its `home` goes there: the cores the
    members read are stale by the time the others read them (one waiting on a socket in the exchange wakes wherever
    the kernel puts it), so that plan does not rest on them."""
    homes = [home(rank, allowed) for rank in range(len(cpus))]
    if any(core is not None for core in homes):
        return {rank: core for rank, core in enumerate(homes) if core is not None and cpus[rank] != core}
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


def move_to(core: int) -> bool:
    """Move the calling thread to `core` now and leave it unpinned (its mask as it was); whether it moved."""
    try:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {core})  # the kernel migrates the thread now
    except OSError:
        return False
    with contextlib.suppress(OSError):  # a mask this thread had a moment ago: never refused in practice
        os.sched_setaffinity(0, allowed)  # and it stays there unpinned
    return True


_HOMES: weakref.WeakKeyDictionary[threading.Thread, list[int]] = weakref.WeakKeyDictionary()
"""Per thread (a rank's, or a test's thread-rank): [its home core, the mailboxes keeping it there]. The first group
that gives the thread a home sets it; its later groups keep it and move nothing, so that the groups of a rank never
pull it between cores."""


def release(thread: threading.Thread | None) -> None:
    """A mailbox that kept `thread` on its home closed: once none does, a later group may give it another."""
    held = _HOMES.get(thread) if thread is not None else None
    if held is not None:
        held[1] -= 1
        if held[1] <= 0:
            del _HOMES[thread]  # type: ignore[arg-type]


def spread(comm: GroupView, c: Call) -> int | None:
    """Move this member off a core it shares with a member of lower rank, or to its home core where the members
    outnumber their cores (see the module); that home core (`Mailbox.home`, which `release`s it on closing), else
    None. A thread that has a home from an earlier group keeps it and moves nothing."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        allowed = set()
    table = np.full((comm.size, 1 + 64), -1, np.int64)  # this member's core, then its allowed cores (up to 64)
    table[comm.rank, 0] = current_cpu()
    mask = sorted(allowed)[:64]
    table[comm.rank, 1 : 1 + len(mask)] = mask
    direct.direct_all_gather(comm, c, table)  # every member takes part, even one that cannot move (a pinned rank)
    thread = threading.current_thread()
    held = _HOMES.get(thread)
    if held is not None:
        held[1] += 1
        return held[0]
    if len(allowed) < 2:
        return None
    masks = [{int(v) for v in row[1:] if v >= 0} for row in table]
    target = plan([int(v) for v in table[:, 0]], masks).get(comm.rank)
    if target is not None and move_to(target) and failure.debug():
        print(f"axond: {comm.g.where('set-up')}: moved from core {table[comm.rank, 0]} to core {target}, spreading "
              f"the group's ranks over their cores", file=sys.stderr, flush=True)
    core = home(comm.rank, masks)
    if core is not None:
        _HOMES[thread] = [core, 1]
    return core
