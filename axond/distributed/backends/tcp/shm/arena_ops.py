"""The tcp backend's collectives through a shared-memory arena, for groups whose ranks share one host.

Each op moves in steps of at most one slot per rank. In a step every rank writes its part into its
own slot of the arena's current buffer, all ranks synchronize (`Sync`: a post without payload through the
group's mailbox where it has one, else a one-byte recursive-doubling exchange over the group's sockets, framed with
the op's header, so a peer in a different op,
dtype or size raises as on sockets), then each rank reads what it needs straight from its peers'
slots. All-reduce adds one stage: rank r reduces the r-th part of the chunk from every slot into
the result slot, and after the next synchronization every rank copies the whole result out.

Buffers alternate per step. A step's slots are only read between its synchronization and the
next one, and the result slot only up to the synchronization after that, so a step's writes never
touch what a slower peer may still be reading: one synchronization per step, plus one at the end
of an all-reduce. Reductions run in rank order, so every rank gets the same numbers.

The same all-reduce runs a host's part of a two-level all-reduce (see `hierarchy.two_level`): between
reducing its part and the last synchronization, each member all-reduces that part with its
counterparts on the other hosts over the sockets.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.backends.host_copy import copy_changed
from axond.distributed.backends.tcp.schedules import doubling, sockets
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm.arena import ShmArena
from axond.distributed.backends.tcp.shm.mailbox import Mailbox
from axond.distributed.backends.tcp.shm.mailbox_ops import SmallBarrier
from axond.distributed.backends.tcp.transport.framing import Call
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, finish_average

BYTES = np.dtype(np.uint8)
POSTS = 64
"""Call shapes whose compiled synchronization a `Sync` keeps (a training loop runs the same few)."""


class Sync:
    """One synchronization of every member between two steps of an arena op: through the mailbox where it is mapped,
    without system calls, else a one-byte exchange over the sockets. Either way the headers are compared: a peer in
    another call raises. Where the mailbox runs compiled ops, each synchronization is one C call
    (`mailbox_ops.SmallBarrier` with the arena op's header, prepared once per call shape). Measurements:
    docs/design/tuning.md#arena-synchronization."""

    def __init__(self, comm: GroupView, mailbox: Mailbox | None) -> None:
        self.comm, self.mailbox = comm, mailbox
        self.token = np.zeros(1, np.uint8)
        self._posts: dict[tuple[int, ...], SmallBarrier] = {}
        """The compiled posts by call shape (the call's header without its number)."""

    def __call__(self, c: Call) -> None:
        box = self.mailbox
        if box is None:
            doubling.recursive_doubling(self.comm, c, self.token, ReduceOp.MAX)
        elif box.native is None:
            box.post(c, None)
        else:
            make_call: Callable[[int], Call] = lambda _: c  # noqa: E731 - this call, for a wait's errors
            shape = c.expect[:4] + c.expect[5:]
            post = self._posts.get(shape)
            if post is None:
                if len(self._posts) >= POSTS:
                    self._posts.clear()
                post = self._posts[shape] = SmallBarrier(box, c, make_call)
            else:
                post.make_call = make_call
            post.run(c.seq)


def _step(arena: ShmArena, step: int) -> int:
    """Bytes per step: a whole slot, or `step` if smaller and not 0."""
    return min(arena.chunk, step) if step > 0 else arena.chunk


def all_reduce(comm: GroupView, arena: ShmArena, sync: Callable[[Call], None], c: Call, x: np.ndarray, op: ReduceOp,
               across: GroupView | None = None, total: int = 0, step: int = 0) -> None:
    """x (flat, contiguous) <- the reduction over ranks, a slot-sized chunk per step (`step` bytes if smaller and
    not 0: `policy.arena_step`).

    With `across` (two levels: `comm` is a host's members, `across` this member and its counterparts on the
    other hosts, `total` the group's size), each part reduced here is then all-reduced with the parts of
    the same index on the other hosts, over the sockets, before anyone copies the result out.
    """
    if comm.size == 2 and across is None:
        _pair_all_reduce(comm, arena, sync, c, x, op, step)
        return
    r, n = comm.rank, comm.size
    ufunc = UFUNCS[op]
    per = _step(arena, step) // x.itemsize
    pending: tuple[np.ndarray, int, int] | None = None
    for s in range(0, x.size, per):
        e = min(s + per, x.size)
        buf = arena.flip()
        slots, result = arena.slots(buf, x.dtype, e - s), arena.result(buf, x.dtype, e - s)
        lo, hi = (e - s) * r // n, (e - s) * (r + 1) // n
        np.copyto(slots[r, :lo], x[s : s + lo])  # part `rank` is reduced by this rank alone: read from x
        np.copyto(slots[r, hi:], x[s + hi : e])
        sync(c)
        if pending is not None:
            np.copyto(x[pending[1] : pending[2]], pending[0])
        mine = result[lo:hi]
        parts = [x[s + lo : s + hi] if k == r else slots[k, lo:hi] for k in range(n)]
        ufunc(parts[0], parts[1], out=mine)
        for part in parts[2:]:
            ufunc(mine, part, out=mine)
        if across is not None:
            if mine.size:  # the counterparts hold parts of the same index and size: all empty or none
                sockets.all_reduce(across, c, mine, ReduceOp.SUM if op is ReduceOp.AVG else op)
            if op is ReduceOp.AVG:
                finish_average(mine, total)
        elif op is ReduceOp.AVG:
            finish_average(mine, n)
        pending = (result, s, e)
    sync(c)
    if pending is not None:
        np.copyto(x[pending[1] : pending[2]], pending[0])


def _pair_all_reduce(comm: GroupView, arena: ShmArena, sync: Callable[[Call], None], c: Call, x: np.ndarray,
                     op: ReduceOp, step: int) -> None:
    """Two ranks: each reduces the whole chunk itself (rank 0's data first, so both get the same numbers);
    that costs no more memory traffic than splitting it and needs one synchronization per step, not two."""
    r = comm.rank
    ufunc = UFUNCS[op]
    per = _step(arena, step) // x.itemsize
    for s in range(0, x.size, per):
        e = min(s + per, x.size)
        slots = arena.slots(arena.flip(), x.dtype, e - s)
        mine = x[s:e]
        np.copyto(slots[r], mine)
        sync(c)
        if r == 0:
            ufunc(mine, slots[1], out=mine)
        else:
            ufunc(slots[0], mine, out=mine)
        if op is ReduceOp.AVG:
            finish_average(mine, 2)


def all_gather(comm: GroupView, arena: ShmArena, sync: Callable[[Call], None], c: Call, out: np.ndarray,
               step: int = 0) -> None:
    """out (size, ...) <- every rank's block; out[rank] already holds this rank's. A slot per step (`step` bytes
    if smaller and not 0).

    `out` may also be a (size, rows, width) uint8 view whose blocks are rows apart (each row contiguous: a two-level
    all_gather's rows in group rank order, see `hierarchy.two_level`): each step moves the same columns of every row.
    """
    r, n = comm.rank, comm.size
    blocks = out.reshape(n, 1, -1).view(np.uint8) if out.flags.c_contiguous else out
    k, width = blocks.shape[1], blocks.shape[2]
    per = max(1, _step(arena, step) // k)
    for s in range(0, width, per):
        e = min(s + per, width)
        slots = arena.slots(arena.flip(), BYTES, k * (e - s)).reshape(n, k, e - s)
        np.copyto(slots[r], blocks[r, :, s:e])
        sync(c)
        np.copyto(blocks[:r, :, s:e], slots[:r])
        np.copyto(blocks[r + 1 :, :, s:e], slots[r + 1 :])


def reduce_scatter(comm: GroupView, arena: ShmArena, sync: Callable[[Call], None], c: Call, src: np.ndarray,
                   out: np.ndarray, op: ReduceOp, order: np.ndarray | None = None, step: int = 0) -> None:
    """out (flat) <- block `rank` of the reduction of every rank's `src` (flat, size x block elements), a slot per
    step (`step` bytes if smaller and not 0).

    With `order` (two levels, see `hierarchy.two_level`), `src` holds len(order) equal blocks and is reduced as if
    laid out in that order (row t: block order[t]), without a copy of it so laid out.

    This rank's own share of the part it reduces is read from `src`, not copied into its slot (no peer reads it)."""
    r, n = comm.rank, comm.size
    ufunc = UFUNCS[op]
    width = src.size // n
    blocks = src.reshape(n, width) if order is None else src.reshape(len(order), -1)
    per = max(1, _step(arena, step) // n // src.itemsize)
    for s in range(0, width, per):
        e = min(s + per, width)
        m = e - s
        slots = arena.slots(arena.flip(), src.dtype, n * m)
        mine = slots[r].reshape(n, m)
        if order is None:
            np.copyto(mine[:r], blocks[:r, s:e])
            np.copyto(mine[r + 1 :], blocks[r + 1 :, s:e])
            own = blocks[r, s:e]
        else:
            own = _copy_laid(mine, blocks, order, s, r)
        sync(c)
        parts = [own if p == r else slots[p, r * m : (r + 1) * m] for p in range(n)]
        dest = out[s:e]
        ufunc(parts[0], parts[1], out=dest)
        for k in range(2, n):
            ufunc(dest, parts[k], out=dest)
        if op is ReduceOp.AVG:
            finish_average(dest, n)


def _copy_laid(dst: np.ndarray, blocks: np.ndarray, order: np.ndarray, s: int, own: int) -> np.ndarray:
    """dst (n, m) <- columns s..s+m of the rows of `blocks` laid out in `order`: row i is blocks order[i * k],
    ..., order[i * k + k - 1] end to end (k = len(order) // n). Row `own`'s columns are returned instead, as a view
    of `blocks` where they lie in one block (else copied into dst[own] as the others)."""
    n, m = dst.shape
    k, block = len(order) // n, blocks.shape[1]
    j, off = divmod(s, block)
    view = blocks[order[own * k + j], off : off + m] if off + m <= block else None
    for i in range(n):
        if i == own and view is not None:
            continue
        pos, e = s, s + m
        while pos < e:
            j, off = divmod(pos, block)
            take = min(e, (j + 1) * block) - pos
            np.copyto(dst[i, pos - s : pos - s + take], blocks[order[i * k + j], off : off + take])
            pos += take
    return dst[own] if view is None else view


def broadcast(comm: GroupView, arena: ShmArena, sync: Callable[[Call], None], c: Call, x: np.ndarray, src: int,
              step: int = 0) -> None:
    """x (flat, contiguous) <- the source rank's x, a slot per step (`step` bytes if smaller and not 0). The buffers
    alternate, so the root copies step k + 1 in while the others copy step k out.

    In groups of more than two the root writes only from the first 4 KiB block its slot does not already hold
    (`copy_changed`, as the mailbox's compiled post skips blocks): where the data did not change, the slot's lines
    stay in the readers' caches. A pair copies plainly: two reads of the data cost more than the copy there
    (docs/design/tuning.md#changed-blocks-only)."""
    data = x.view(np.uint8)
    per = _step(arena, step)
    copy_in = copy_changed if comm.size > 2 else np.copyto
    for s in range(0, data.size, per):
        e = min(s + per, data.size)
        slot = arena.slots(arena.flip(), BYTES, e - s)[src]
        if comm.rank == src:
            copy_in(slot, data[s:e])
        sync(c)
        if comm.rank != src:
            np.copyto(data[s:e], slot)
