"""Arrays in shared memory from the start (`axond.shared_empty`), which the ranks of one host read with a plain
memory copy instead of `process_vm_readv`.

The tcp backend's single-copy path (`tcp.shm.single_copy`) reads a peer's buffer through the kernel, which copies at
11-13 GB/s on this
project's VM where a memcpy runs at 20-45. An array from `shared_empty` lives in a memfd of its own (never a file
in /dev/shm: nothing outlives the process); when one is a collective's buffer, the rank publishes the memfd's
number and a random token beside the usual (pid, address, bytes), and a peer on the path opens
`/proc/PID/fd/N` (the same permission as `process_vm_readv`: reading the owner's memory), checks the token in
the memfd's name, maps it read-only once and copies from it, or reduces straight from it, at memory speed.

The owner side (`shared_empty`, `find`) keeps a registry of its live segments by address, dropped with the last
array or view of a segment; the reader side (`Mappings`) keeps at most MAPPED peer segments mapped, and drops
those their owner freed whenever it maps a new one of that owner. Where a peer's segment cannot be mapped (a /proc
without it, a kernel without memfds), the read falls back to `process_vm_readv`. Large copies from a mapping take
`host_copy.large_copy` (`rep movsb` where it is fast).
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict
from math import prod
from typing import Any

import numpy as np

from axond.distributed.backends.host_copy import PAGE, address

NAME = "axond-shared"
"""memfds are named NAME-TOKEN (the token in hex), which a reader checks before mapping one."""
MAPPED = 32
"""Peer segments a rank keeps mapped (least recently used dropped first)."""

_lock = threading.Lock()
_starts: list[int] = []
_segments: dict[int, tuple[int, int, int]] = {}
"""start address -> (end address, memfd, token) of this process's live segments."""


def shared_empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A new C-contiguous array (zero-filled) in shared memory that the ranks on this host read at memory speed
    when it is the buffer of a large collective (the single-copy path; see the shared-memory design page).
    Use it like `numpy.empty`; views of it count as well. Its memory is freed with the last array or view of it."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ValueError(f"shared_empty: shape {shape!r} must be non-negative integers")
    kind = np.dtype(dtype)
    if kind.hasobject:
        raise TypeError(f"shared_empty: dtype {kind} holds Python objects; use a numeric dtype")
    nbytes = prod(int(d) for d in dims) * kind.itemsize
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    token = secrets.randbits(62)
    fd = os.memfd_create(f"{NAME}-{token:x}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        segment = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    whole = np.frombuffer(segment, np.uint8)
    start = address(whole)
    with _lock:
        if start not in _segments:
            bisect.insort(_starts, start)
        _segments[start] = (start + size, fd, token)  # replaces a freed segment at this address not released yet
    weakref.finalize(segment, _release, start, fd)
    return whole[:nbytes].view(kind).reshape(tuple(int(d) for d in dims))


def _release(start: int, fd: int) -> None:
    """Forget the segment at `start` (unless a newer one took its address, once it was unmapped) and close its
    memfd."""
    with _lock:
        entry = _segments.get(start)
        if entry is not None and entry[1] == fd:
            del _segments[start]
            del _starts[bisect.bisect_left(_starts, start)]
    os.close(fd)


def find(base: int, nbytes: int) -> tuple[int, int, int] | None:
    """(memfd, token, offset in the segment) of the live `shared_empty` segment holding bytes base..base+nbytes of
    this process, or None."""
    with _lock:
        k = bisect.bisect_right(_starts, base) - 1
        if k < 0:
            return None
        start = _starts[k]
        end, fd, token = _segments[start]
    if base + nbytes > end:
        return None
    return fd, token, base - start


class Mappings:
    """Peer segments this rank mapped read-only, by (pid, memfd, token); at most MAPPED of them."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def view(self, pid: int, fd: int, token: int, end: int) -> np.ndarray | None:
        """The bytes of peer `pid`'s segment (memfd `fd` holding `token`) from 0 to at least `end`, mapped
        read-only; None if it cannot be mapped (the caller reads through the kernel instead)."""
        key = (pid, fd, token)
        got = self._maps.get(key)
        if got is not None and got.size >= end:
            self._maps.move_to_end(key)
            return got
        if min(pid, fd, token, end) < 0 or not _names(pid, fd, token):
            return None  # the number names another file now: the owner freed that array
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            size = os.fstat(own).st_size
            if size < end:
                return None
            mapped = np.frombuffer(mmap.mmap(own, size, mmap.MAP_SHARED, mmap.PROT_READ), np.uint8)
        except (OSError, ValueError):
            return None
        finally:
            os.close(own)
        self._prune(pid)
        self._maps[key] = mapped
        while len(self._maps) > MAPPED:
            self._maps.popitem(last=False)
        return mapped

    def _prune(self, pid: int) -> None:
        """Drop the mappings of `pid`'s segments that it freed (their memfd number no longer names their token), so
        that a freed segment's memory is not kept alive here."""
        for key in [k for k in self._maps if k[0] == pid]:
            if not _names(*key):
                del self._maps[key]

    def clear(self) -> None:
        self._maps.clear()


def _names(pid: int, fd: int, token: int) -> bool:
    """Whether descriptor `fd` of process `pid` is the memfd of a `shared_empty` segment holding `token`."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}") == f"/memfd:{NAME}-{token:x} (deleted)"
    except OSError:
        return False
