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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from axond.distributed.framing import Call, FramedGroup
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import UFUNCS, finish_average
from axond.distributed.shm import AUTO_MIN_BYTES, NAME_BYTES, ShmArena, ShmTuning, available, unlink
from axond.distributed.wire import OP_NAMES


class ShmAlgorithms:
    """Mixed into `TcpBackend`: shared-memory schedules plus the arena's set-up, agreed by every member."""

    g: FramedGroup
    crowded: bool
    rank: int
    size: int
    shm: ShmTuning
    _arena: ShmArena | None
    """The mapped arena, once set up (None before, or if some member could not map it)."""
    _arena_tried: bool
    _local: bool
    """Whether every peer was reached through a local address (see `peer.same_host`)."""
    _token: np.ndarray

    _recursive_doubling: Callable[[Call, np.ndarray, ReduceOp], None]
    _tree_broadcast: Callable[[Call, np.ndarray, int], None]

    def _use_shm(self, c: Call, nbytes: int, scale: int = 1) -> ShmArena | None:
        """The arena, if an op on `nbytes` should go through it: from `scale` times the threshold (2 for an
        all_reduce that synchronizes twice per step, and for broadcast, whose socket path is one message per
        rank). Set up on first use: every member agrees or none uses it."""
        if self.size == 1 or not self.shm.enabled or nbytes < scale * self._shm_min_bytes():
            return None
        if not self._arena_tried:
            self._arena_tried = True
            self._arena = self.g.run(OP_NAMES[c.op], self._set_up, c)
        return self._arena

    def _shm_min_bytes(self) -> int:
        """AXOND_SHM_MIN_BYTES, or by default AUTO_MIN_BYTES[crowded]: with more ranks than cores every
        synchronization costs a few context switches, so the path pays off only on larger ops."""
        return self.shm.min_bytes if self.shm.min_bytes >= 0 else AUTO_MIN_BYTES[self.crowded]

    def _set_up(self, c: Call) -> ShmArena | None:
        """Rank 0 creates the arena and sends its name; each member maps it; a MIN over "mapped" decides.

        Rank 0 unlinks the file once everyone has answered (or the set-up failed), so it never outlives
        the processes that map it.
        """
        arena: ShmArena | None = None
        name = np.zeros(NAME_BYTES, np.uint8)
        try:
            if self.rank == 0 and self._local and available():
                try:
                    arena = ShmArena.create(self.size, self.shm.arena_bytes)
                    name = arena.name()
                except OSError:
                    arena = None
            self._tree_broadcast(c, name, 0)
            if self.rank != 0 and name.any() and self._local:
                try:
                    arena = ShmArena.attach(name, self.size, self.shm.arena_bytes)
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

    def _shm_all_reduce(self, c: Call, arena: ShmArena, x: np.ndarray, op: ReduceOp) -> None:
        """x (flat, contiguous) <- the reduction over ranks, a slot-sized chunk per step."""
        if self.size == 2:
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
            if op is ReduceOp.AVG:
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
