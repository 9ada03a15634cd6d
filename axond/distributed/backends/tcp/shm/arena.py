"""A shared-memory arena for the ranks of a group that share one host (the tcp backend's large ops on one host).

Over loopback every byte a rank sends is copied twice by the kernel (into the socket, out of it),
and on a host with fewer cores than ranks those copies are the bottleneck. Ranks on one host can
instead write their data once into a `/dev/shm` file that every member maps, read their peers'
data straight from it, and use the group's sockets only to synchronize (a one-byte frame per
member and step, carrying the op's header, so mismatched calls still raise on every rank).

The arena is created by group rank 0 under a random name with mode 0600, reserved with
`posix_fallocate` (so a full `/dev/shm` is an error at creation, never a SIGBUS later), mapped
by every member, and unlinked as soon as everyone has mapped it: nothing is left behind if a
process dies. Layout: two buffers used in turn, each holding one slot per rank plus one result
slot of `chunk` bytes.

The data arena starts each slot SLOT_SHIFT bytes into a page, where glibc puts the arrays it maps for NumPy
(large ones, past malloc's mmap threshold): a copy between such an array and a slot then runs at equal page
offsets. A page-aligned slot would start 16 bytes before such an array, the distance at which AMD's string copy
(`rep movsb`) runs 10x slower for 4-512 KiB (see `host_copy`): an all_gather of 256 KiB on 2 ranks took 2x longer.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

SHM_DIR = "/dev/shm"
NAME_BYTES = 64
"""Size of the frame that carries the arena's file name from rank 0 to the others."""
ALIGN = 64
PAGE = 4096
SLOT_SHIFT = 16
"""Where the data arena's slots start in a page (`shift`): where glibc's mmap'd arrays start (after its 16-byte
chunk header)."""


def chunk_bytes(arena_bytes: int, size: int) -> int:
    """Bytes per slot of an arena of about `arena_bytes` for `size` ranks: two buffers of size + 1 slots."""
    per = arena_bytes // (2 * (size + 1))
    return max(ALIGN, min(per, 4 << 20) // ALIGN * ALIGN)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class ShmArena:
    """One group's mapping of the shared file: `slots(buf, dtype, count)` and `result(buf, ...)` views."""

    def __init__(self, path: str, size: int, chunk: int, create: bool, shift: int = 0) -> None:
        self.path, self.size, self.chunk = path, size, chunk
        stride = -(-(chunk + shift) // PAGE) * PAGE if shift else chunk
        """Bytes from one slot to the next: whole pages when slots start `shift` bytes into one."""
        nbytes = 2 * (size + 1) * stride
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
            self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                unlink(path)
            raise
        os.close(fd)
        self._bytes = np.frombuffer(self._map, np.uint8).reshape(2, size + 1, stride)[:, :, shift : shift + chunk]
        self.turn = 0
        """Which buffer the next step uses; every member flips it at the same steps."""

    @classmethod
    def create(cls, size: int, arena_bytes: int, shift: int = 0) -> ShmArena:
        path = os.path.join(SHM_DIR, f"axond-{os.getpid()}-{secrets.token_hex(12)}")
        return cls(path, size, chunk_bytes(arena_bytes, size), create=True, shift=shift)

    @classmethod
    def attach(cls, name: np.ndarray, size: int, arena_bytes: int, shift: int = 0) -> ShmArena:
        """Map the arena whose file name rank 0 sent (`name`, NUL-padded); raises OSError/ValueError if absent."""
        base = bytes(name).rstrip(b"\0").decode()
        if not base.startswith("axond-") or "/" in base:
            raise ValueError(f"not an axond arena name: {base!r}")
        return cls(os.path.join(SHM_DIR, base), size, chunk_bytes(arena_bytes, size), create=False, shift=shift)

    def name(self) -> np.ndarray:
        out = np.zeros(NAME_BYTES, np.uint8)
        base = os.path.basename(self.path).encode()
        out[: len(base)] = np.frombuffer(base, np.uint8)
        return out

    def flip(self) -> int:
        """The buffer of the next step (each step alternates, so a step never writes what the last one reads)."""
        buf, self.turn = self.turn, self.turn ^ 1
        return buf

    def slots(self, buf: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Every rank's slot of buffer `buf` as a (size, count) array of `dtype`."""
        return self._bytes[buf, : self.size, : count * dtype.itemsize].view(dtype)

    def buffer(self) -> memoryview:
        """The whole mapping as bytes (release it before `close`)."""
        assert self._map is not None
        return memoryview(self._map)

    def mapping(self) -> mmap.mmap:
        """The mapping itself: its slices are bytes, which compare in half the time of a memoryview's."""
        assert self._map is not None
        return self._map

    def result(self, buf: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._bytes[buf, self.size, : count * dtype.itemsize].view(dtype)

    def close(self) -> None:
        """Unmap (views still held elsewhere keep the mapping alive until they are collected)."""
        mapping, self._map = self._map, None
        self._bytes = np.empty((2, 0, 0), np.uint8)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
