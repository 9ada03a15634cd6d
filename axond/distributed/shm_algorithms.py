"""The tcp backend's collectives through a shared-memory arena, for groups whose ranks share one host.

Each op moves in steps of at most one slot per rank. In a step every rank writes its part into its
own slot of the arena's current buffer, all ranks synchronize (a one-byte recursive-doubling
exchange over the group's sockets, framed with the op's header, so a peer in a different op,
dtype or size raises as on sockets), then each rank reads what it needs straight from its peers'
slots. All-reduce adds one stage: rank r reduces the r-th part of the chunk from every slot into
the result slot, and after the next synchronization every rank copies the whole result out.

Buffers alternate per step. A step's slots are only read between its synchronization and the
next one, and the result slot only up to the synchronization after that, so a step's writes never
touch what a slower peer may still be reading: one synchronization per step, plus one at the end
of an all-reduce. Reductions run in rank order, so every rank gets the same numbers.

The same mixin runs a node's part of a two-level all-reduce on a `Team` (see `shm_plan`): between
reducing its part and the last synchronization, each member all-reduces that part with its
counterparts on the other nodes over the sockets.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.framing import Call, FramedGroup
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import UFUNCS, finish_average
from axond.distributed.shm import (AUTO_MIN_BYTES, MAILBOX_SYNC_MIN_BYTES, NAME_BYTES, ShmArena, ShmTuning,
                                  available, unlink)


class ShmAlgorithms:
    """Mixed into `TcpBackend` (and `Team`): shared-memory schedules plus the arena's set-up, agreed by every member."""

    g: FramedGroup
    crowded: bool
    rank: int
    size: int
    shm: ShmTuning
    _arena: ShmArena | None
    """The mapped arena of a group on one node, once set up (None before, or if some member could not map it)."""
    _token: np.ndarray

    _recursive_doubling: Callable[[Call, np.ndarray, ReduceOp], None]
    _tree_broadcast: Callable[[Call, np.ndarray, int], None]
    _all_reduce_flat: Callable[[Call, np.ndarray, ReduceOp], None]

    def _shm_min_bytes(self, spin: bool = False) -> int:
        """AXOND_SHM_MIN_BYTES, or by default: MAILBOX_SYNC_MIN_BYTES if the steps synchronize through the mailbox
        (`spin`), else AUTO_MIN_BYTES[crowded] (with more ranks than cores every synchronization over the sockets
        costs a few context switches, so the path pays off only on larger ops)."""
        if self.shm.min_bytes >= 0:
            return self.shm.min_bytes
        return MAILBOX_SYNC_MIN_BYTES if spin else AUTO_MIN_BYTES[self.crowded]

    def _make_arena(self, c: Call, nbytes: int = 0) -> ShmArena | None:
        """Rank 0 creates the arena and sends its name; each member maps it; a MIN over "mapped" decides.

        Rank 0 unlinks the file once everyone has answered (or the set-up failed), so it never outlives
        the processes that map it. `nbytes`: the arena's size (0: AXOND_SHM_ARENA_BYTES).
        """
        nbytes = nbytes or self.shm.arena_bytes
        arena: ShmArena | None = None
        name = np.zeros(NAME_BYTES, np.uint8)
        try:
            if self.rank == 0 and available():
                try:
                    arena = ShmArena.create(self.size, nbytes)
                    name = arena.name()
                except OSError:
                    arena = None
            self._tree_broadcast(c, name, 0)
            if self.rank != 0 and name.any():
                try:
                    arena = ShmArena.attach(name, self.size, nbytes)
                except (OSError, ValueError):
                    arena = None
            mapped = np.array([arena is not None], np.uint8)
            self._recursive_doubling(c, mapped, ReduceOp.MIN)
        except BaseException:
            if arena is not None:
                arena.close()
            raise
        finally:
            if self.rank == 0 and arena is not None:
                unlink(arena.path)
        if not mapped[0]:
            if arena is not None:
                arena.close()
            return None
        return arena

    def _sync(self, c: Call) -> None:
        self._recursive_doubling(c, self._token, ReduceOp.MAX)

    def _shm_all_reduce(self, c: Call, arena: ShmArena, x: np.ndarray, op: ReduceOp,
                        across: ShmAlgorithms | None = None, total: int = 0) -> None:
        """x (flat, contiguous) <- the reduction over ranks, a slot-sized chunk per step.

        With `across` (hierarchical: this is a node's team, `across` this member and its counterparts on the
        other nodes, `total` the group's size), each part reduced here is then all-reduced with the parts of
        the same index on the other nodes, over the sockets, before anyone copies the result out.
        """
        if self.size == 2 and across is None:
            self._shm_pair_all_reduce(c, arena, x, op)
            return
        r, n = self.rank, self.size
        ufunc = UFUNCS[op]
        per = arena.chunk // x.itemsize
        pending: tuple[np.ndarray, int, int] | None = None
        for s in range(0, x.size, per):
            e = min(s + per, x.size)
            buf = arena.flip()
            slots, result = arena.slots(buf, x.dtype, e - s), arena.result(buf, x.dtype, e - s)
            lo, hi = (e - s) * r // n, (e - s) * (r + 1) // n
            np.copyto(slots[r, :lo], x[s : s + lo])  # part `rank` is reduced by this rank alone: read from x
            np.copyto(slots[r, hi:], x[s + hi : e])
            self._sync(c)
            if pending is not None:
                np.copyto(x[pending[1] : pending[2]], pending[0])
            mine = result[lo:hi]
            parts = [x[s + lo : s + hi] if k == r else slots[k, lo:hi] for k in range(n)]
            ufunc(parts[0], parts[1], out=mine)
            for part in parts[2:]:
                ufunc(mine, part, out=mine)
            if across is not None:
                if mine.size:  # the counterparts hold parts of the same index and size: all empty or none
                    across._all_reduce_flat(c, mine, ReduceOp.SUM if op is ReduceOp.AVG else op)
                if op is ReduceOp.AVG:
                    finish_average(mine, total)
            elif op is ReduceOp.AVG:
                finish_average(mine, n)
            pending = (result, s, e)
        self._sync(c)
        if pending is not None:
            np.copyto(x[pending[1] : pending[2]], pending[0])

    def _shm_pair_all_reduce(self, c: Call, arena: ShmArena, x: np.ndarray, op: ReduceOp) -> None:
        """Two ranks: each reduces the whole chunk itself (rank 0's data first, so both get the same numbers);
        that costs no more memory traffic than splitting it and needs one synchronization per step, not two."""
        r = self.rank
        ufunc = UFUNCS[op]
        per = arena.chunk // x.itemsize
        for s in range(0, x.size, per):
            e = min(s + per, x.size)
            slots = arena.slots(arena.flip(), x.dtype, e - s)
            mine = x[s:e]
            np.copyto(slots[r], mine)
            self._sync(c)
            if r == 0:
                ufunc(mine, slots[1], out=mine)
            else:
                ufunc(slots[0], mine, out=mine)
            if op is ReduceOp.AVG:
                finish_average(mine, 2)

    def _shm_all_gather(self, c: Call, arena: ShmArena, out: np.ndarray) -> None:
        """out (size, ...) <- every rank's block; out[rank] already holds this rank's."""
        r, n = self.rank, self.size
        blocks = out.reshape(n, -1).view(np.uint8)
        per = arena.chunk
        for s in range(0, blocks.shape[1], per):
            e = min(s + per, blocks.shape[1])
            slots = arena.slots(arena.flip(), np.dtype(np.uint8), e - s)
            np.copyto(slots[r], blocks[r, s:e])
            self._sync(c)
            np.copyto(blocks[:r, s:e], slots[:r])
            np.copyto(blocks[r + 1 :, s:e], slots[r + 1 :])

    def _shm_reduce_scatter(self, c: Call, arena: ShmArena, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """out (flat) <- block `rank` of the reduction of every rank's `src` (flat, size x block elements)."""
        r, n = self.rank, self.size
        ufunc = UFUNCS[op]
        blocks = src.reshape(n, -1)
        per = max(1, arena.chunk // n // src.itemsize)
        for s in range(0, blocks.shape[1], per):
            e = min(s + per, blocks.shape[1])
            m = e - s
            slots = arena.slots(arena.flip(), src.dtype, n * m)
            np.copyto(slots[r].reshape(n, m), blocks[:, s:e])
            self._sync(c)
            part = slots[:, r * m : (r + 1) * m]
            dest = out[s:e]
            ufunc(part[0], part[1], out=dest)
            for k in range(2, n):
                ufunc(dest, part[k], out=dest)
            if op is ReduceOp.AVG:
                finish_average(dest, n)

    def _shm_broadcast(self, c: Call, arena: ShmArena, x: np.ndarray, src: int) -> None:
        """x (flat, contiguous) <- the source rank's x, a slot per step."""
        data = x.view(np.uint8)
        per = arena.chunk
        for s in range(0, data.size, per):
            e = min(s + per, data.size)
            slot = arena.slots(arena.flip(), np.dtype(np.uint8), e - s)[src]
            if self.rank == src:
                np.copyto(slot, data[s:e])
            self._sync(c)
            if self.rank != src:
                np.copyto(data[s:e], slot)
