"""ZeRO-1 shards copied into the worker daemon's memory: each rank's block (parameters and optimizer state, tagged with
the committed step) survives the rank's death, and the replacement rank its worker starts offers it to the survivors.

The worker gives each local rank one anonymous shared-memory file (`memfd`), inherited by the rank process as
`AXOND_SHARD_MEMORY_FD`: the worker holds it open, so its contents outlive the rank, reach the next rank the worker
starts for that local rank, and go when the worker ends (nothing is left in `/dev/shm`). The rank maps it and, after
every committed step (every `copy_every`-th with buddy copies on), copies its block into it on a background thread (one
copy per array, off the training thread); the copy is waited for only before the next optimizer step changes the arrays.

Cost (`python bench/shard_copies.py`): the copy is bound by memory bandwidth, its source (the block the optimizer
just updated) out of cache. Both slots are mapped with their pages faulted in once, when the file is sized or
attached (`MAP_POPULATE`), so no copy takes page faults; each array is copied with non-temporal stores
(`host_copy.stream_copy`), so the snapshot, which this process never reads, is written to memory without first being
read into the cache (glibc's memcpy does that below a threshold of hundreds of MB); the views of the slots are made
once per layout, so a step allocates nothing but the few Python objects of the hand-off to the thread.

Under `axond worker` the buddy copy is sent from here by the worker (`forward`: the request is written into this
memory's header after the copy, on the same background thread, and the worker told through a pipe), to the buddy's
worker (`axond.train.relay`): the rank itself neither reads nor sends it.

Layout (`axond.copy_layout`): a header page, then two slots (double buffering). A copy goes into the slot that does not
hold the newest complete copy; the slot's header is cleared first and written last, its `state` word after every other:
a copy cut half-way (the rank killed mid-memcpy) leaves its slot marked empty and the other slot's copy intact. A copy
is offered (`holding`) only when its header is complete, it matches this job's layout (a fingerprint of the shard
geometry and the optimizer state's names) and lineage (bumped when the job falls back to a checkpoint), and its tag is
the agreed step, or the step before it when the gradient of the agreed step is at hand to advance it
(`axond.train.reassemble`).
"""

from __future__ import annotations

import mmap
import os
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from axond.copy_layout import (ADDRESS_AT, ADDRESS_BYTES, ALIGN, COUNT, FIRST, FORWARD_BASE, FORWARD_BYTES,
                               FORWARD_DONE, FORWARD_RESULT, FORWARD_SEQ, FORWARD_SLOT, FORWARD_TAG, HEADER_BYTES,
                               LINEAGE, MAGIC, REFUSED_MALFORMED, REFUSED_NO_MEMORY, REFUSED_TOO_LARGE, REFUSED_TORN,
                               SCALARS, SLOT_WORDS, STATE, TAG, UNSENT, VALID, WIDTH, rows_bytes, slot_need,
                               slot_offset)
from axond.distributed.backends.host_copy import stream_copy
from axond.parallel.zero.virtual import VirtualZero
from axond.train.buddy import Holding, Slot

POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Fault every page of the mapping in when it is made (Linux): the copies then never stop on a page fault."""


def fingerprint(zero: VirtualZero) -> int:
    """The geometry a copy must share with the job to be read: virtual shards, shard size, dtype, state names."""
    arrays, scalars = zero.schema()
    text = f"{zero.virtual}:{zero.shard}:{zero.flat.dtype.str}:{','.join(arrays)}:{','.join(scalars)}"
    return zlib.crc32(text.encode())


def region_views(buffer: mmap.mmap, base: int, slot_bytes: int, index: int, zero: VirtualZero, count: int, width: int,
                 nscalars: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot `index`'s (rows, scalars) of the region at `base` (`axond.copy_layout`), read and written in place."""
    rows = count * width * zero.shard
    offset = base + slot_offset(slot_bytes, index)
    data = np.frombuffer(buffer, zero.flat.dtype, rows, offset).reshape(count, width, zero.shard)
    start = offset + rows_bytes(count, width, zero.shard, zero.flat.dtype.itemsize)
    return data, np.frombuffer(buffer, np.float64, count * nscalars, start).reshape(count, nscalars)


def region_slots(buffer: mmap.mmap, base: int, slot_bytes: int, zero: VirtualZero,
                 lineage: int) -> list[tuple[int, Slot, range]]:
    """The complete copies in the region at `base` of this job's layout and `lineage`: (tag, slot, shards), each
    slot's views reading the memory in place; a copy whose scalars' own tags disagree with its header is left out."""
    header = np.frombuffer(buffer, np.int64, 4 + 2 * SLOT_WORDS, base)
    if int(header[0]) != MAGIC or int(header[1]) != fingerprint(zero):
        return []
    (_, width, _), (_, nscalars) = zero.rows_shape(1)
    found = []
    for i in range(2):
        words = header[4 + i * SLOT_WORDS : 4 + (i + 1) * SLOT_WORDS]
        if int(words[STATE]) != VALID or int(words[LINEAGE]) != lineage:
            continue
        if int(words[WIDTH]) != width or int(words[SCALARS]) != nscalars:
            continue
        tag, first, count = int(words[TAG]), int(words[FIRST]), int(words[COUNT])
        if count <= 0 or first < 0 or first + count > zero.virtual:
            continue
        if slot_need(count, width, zero.shard, zero.flat.dtype.itemsize, nscalars) > slot_bytes:
            continue
        rows, scalars = region_views(buffer, base, slot_bytes, i, zero, count, width, nscalars)
        if {int(t) for t in scalars[:, 0]} == {tag}:
            found.append((tag, Slot(rows, scalars, tag), range(first, first + count)))
    return found


class DaemonCopy:
    """This rank's copies in the memory its worker daemon holds (see the module docstring)."""

    def __init__(self, fd: int, zero: VirtualZero) -> None:
        self.fd, self.zero = fd, zero
        self._map: mmap.mmap | None = None
        self._header = np.zeros(2 * SLOT_WORDS + 4, np.int64)
        self._request = np.zeros(6, np.int64)
        self._slot_bytes = 0
        self._views: dict[tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        """The slots' views by (slot, shards, rows per shard, scalars per shard): made once per layout."""
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.forward_fd: int | None = None
        """The pipe to this rank's worker that asks it to send a copy (`AXOND_COPY_FORWARD_FD`); None: no worker."""
        self.forward_to: str | None = None
        """The buddy's worker's relay ("host:port") `forward` asks for the copy to be sent to; None: nowhere."""
        self._seq = 0
        self.written = -1
        """The tag of the last copy posted."""
        self.busy_s = 0.0
        """Seconds the training thread spent on the copies (posting, waiting for one in flight): their cost there."""
        self.copy_cpu_s = 0.0
        """CPU seconds the background thread spent copying (the memcpy itself)."""
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise ValueError(f"AXOND_SHARD_MEMORY_FD={fd} is not an open file descriptor ({e.strerror}): it is set by "
                             "`axond worker` for the ranks it starts; unset it elsewhere") from e
        if size >= HEADER_BYTES:
            self._attach(size)

    def _attach(self, size: int) -> None:
        self._views = {}
        self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED | POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        self._header = np.frombuffer(self._map, np.int64, 4 + 2 * SLOT_WORDS)
        self._request = np.frombuffer(self._map, np.int64, 6, FORWARD_BASE * 8)
        self._seq = max(self._seq, int(self._request[FORWARD_SEQ]), int(self._request[FORWARD_DONE]))
        self._slot_bytes = (size - HEADER_BYTES) // 2

    def _slot_views(self, index: int, count: int, width: int, nscalars: int) -> tuple[np.ndarray, np.ndarray]:
        key = (index, count, width, nscalars)
        views = self._views.get(key)
        if views is None:
            assert self._map is not None
            views = self._views[key] = region_views(self._map, 0, self._slot_bytes, index, self.zero, count, width,
                                                    nscalars)
        return views

    def _need(self, count: int, width: int, nscalars: int) -> int:
        return slot_need(count, width, self.zero.shard, self.zero.flat.dtype.itemsize, nscalars)

    def _words(self, index: int) -> np.ndarray:
        return self._header[4 + index * SLOT_WORDS : 4 + (index + 1) * SLOT_WORDS]

    def _fits(self, count: int, width: int, nscalars: int) -> bool:
        return self._map is not None and self._need(count, width, nscalars) <= self._slot_bytes \
            and int(self._header[0]) == MAGIC and int(self._header[1]) == fingerprint(self.zero)

    def _layout(self, count: int, width: int, nscalars: int) -> None:
        """Size the file for two slots of `count` shards (both slots emptied: a new geometry)."""
        slot = -(-self._need(count, width, nscalars) // ALIGN) * ALIGN
        self._close_map()
        # never smaller: the worker may still read a slot of the old layout (a send it was asked for)
        size = max(HEADER_BYTES + 2 * slot, os.fstat(self.fd).st_size)
        os.ftruncate(self.fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, 0, size)  # a full /dev/shm fails here, never as a SIGBUS mid-copy
        self._attach(size)
        self._header[:] = 0
        self._header[1] = fingerprint(self.zero)
        self._header[0] = MAGIC

    def _close_map(self) -> None:
        mapping, self._map = self._map, None
        self._views = {}
        self._header = np.zeros(2 * SLOT_WORDS + 4, np.int64)
        self._request = np.zeros(6, np.int64)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # views still held (a holding offered in a recovery): freed with them
                pass

    def newest(self) -> int | None:
        """The index of the slot with the newest complete copy, or None."""
        done = [i for i in range(2) if int(self._words(i)[STATE]) == VALID]
        return max(done, key=lambda i: int(self._words(i)[TAG])) if done else None

    def post(self, lineage: int) -> None:
        """Copy this rank's block, tagged with the zero optimizer's step and the job's `lineage`, into the slot not
        holding the newest copy (on the background thread; `settle()` waits for it)."""
        self.settle()
        began = time.perf_counter()
        z = self.zero
        count = len(z.mine)
        (_, width, _), (_, nscalars) = z.rows_shape(count)
        if not self._fits(count, width, nscalars):  # (a send the worker may still make of the old layout reads a
            self._layout(count, width, nscalars)  # file that never shrinks, and it says a slot written again torn)
        newest = self.newest()
        index = 1 if newest == 0 else 0
        words = self._words(index)
        words[STATE] = 0  # cleared before the data: a copy cut from here on is never read
        rows, scalars = self._slot_views(index, count, width, nscalars)
        sources = [z.arrays(v, scalars[i]) for i, v in enumerate(z.mine)]  # the live arrays; scalars filled now
        header = (z.tag, z.mine.start, count, lineage, width, nscalars)
        self._pending = self._executor().submit(self._timed, words, rows, sources, header)
        self.written = z.tag
        self.busy_s += time.perf_counter() - began

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="axond-daemon-copy")
        return self._pool

    def _timed(self, words: np.ndarray, rows: np.ndarray, sources: list[list[np.ndarray]],
               header: tuple[int, int, int, int, int, int]) -> None:
        began = time.thread_time()
        _write(words, rows, sources, header)
        self.copy_cpu_s += time.thread_time() - began

    def forward(self, tag: int) -> Forwarding | None:
        """Ask this rank's worker to send the copy tagged `tag` (posted, perhaps still being written: the request is
        made on the background thread, after the copy) to `forward_to`; None when there is nowhere to send it."""
        if self.forward_fd is None or not self.forward_to:
            return None
        self._seq += 1
        job = self._executor().submit(self._ask, tag, self._seq, self.forward_to.encode())
        return Forwarding(self, job, self._seq)

    def _ask(self, tag: int, seq: int, address: bytes) -> None:
        if self._map is None or self.forward_fd is None:
            raise ValueError(f"no daemon memory or worker pipe to send the copy of step {tag} from")
        index = next((i for i in range(2) if int(self._words(i)[STATE]) == VALID and int(self._words(i)[TAG]) == tag),
                     None)
        if index is None:
            raise ValueError(f"no complete copy of step {tag} in this rank's daemon memory to send")
        words = self._words(index)
        self._request[FORWARD_TAG], self._request[FORWARD_SLOT] = tag, index
        self._request[FORWARD_BYTES] = self._need(int(words[COUNT]), int(words[WIDTH]), int(words[SCALARS]))
        self._map[ADDRESS_AT : ADDRESS_AT + ADDRESS_BYTES] = address.ljust(ADDRESS_BYTES, b"\0")[:ADDRESS_BYTES]
        self._request[FORWARD_SEQ] = seq  # last: the worker reads the request after it
        os.write(self.forward_fd, b"\1")

    def settle(self) -> None:
        """Wait for the copy in flight (before the arrays it reads change: the next optimizer step, a re-sharding)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            began = time.perf_counter()
            pending.result()
            self.busy_s += time.perf_counter() - began

    def holding(self, agreed: int, lineage: int) -> Holding | None:
        """The newest complete copy of this job's layout and `lineage` tagged `agreed` or `agreed - 1`, as a holding
        `axond.train.reassemble` offers from (its `grads` to be filled for a copy one step old); None if there is none.
        Its slot views read the daemon's memory in place."""
        if self._map is None:
            return None
        found = [(tag, slot, shards) for tag, slot, shards in region_slots(self._map, 0, self._slot_bytes, self.zero,
                                                                           lineage) if agreed - 1 <= tag <= agreed]
        if not found:
            return None
        tag, slot, shards = max(found, key=lambda f: f[0])
        return Holding(-1, shards, [slot])

    def close(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _write(words: np.ndarray, rows: np.ndarray, sources: list[list[np.ndarray]],
           header: tuple[int, int, int, int, int, int]) -> None:
    """The background copy: every array into the slot, then the header, its state word last."""
    for i, arrays in enumerate(sources):
        for j, array in enumerate(arrays):
            stream_copy(rows[i, j], array)
    tag, first, count, lineage, width, nscalars = header
    words[TAG], words[FIRST], words[COUNT], words[LINEAGE] = tag, first, count, lineage
    words[WIDTH], words[SCALARS] = width, nscalars
    words[STATE] = VALID


REFUSED = {REFUSED_MALFORMED: "its fields did not fit together", REFUSED_TOO_LARGE: "it was over the relay's bound",
           REFUSED_NO_MEMORY: "the buddy's worker could not size its memory for it (is /dev/shm full?)",
           REFUSED_TORN: "the slot was written again while it was sent", UNSENT: "the worker could not send it "
           "(its log says why)"}


class Forwarding:
    """A send asked of the worker (`DaemonCopy.forward`): `result` waits for the worker's answer."""

    def __init__(self, copy: DaemonCopy, job: Future[None], seq: int) -> None:
        self.copy, self.job, self.seq = copy, job, seq

    def result(self, timeout: float | None = None) -> int:
        """The tag the buddy's worker kept; raises `TimeoutError` if the answer did not come within `timeout`,
        `ValueError` if the copy was not kept."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        self.job.result(timeout)
        while int(self.copy._request[FORWARD_DONE]) < self.seq:  # (its mapping is made again at a new layout)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the worker did not answer the send of copy {self.seq} in time")
            time.sleep(0.0005)
        kept = int(self.copy._request[FORWARD_RESULT])
        if kept < 0:
            raise ValueError(f"the buddy copy was not kept: {REFUSED.get(kept, kept)}")
        return kept
