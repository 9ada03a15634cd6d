"""A shared-memory arena for the ranks of a group that share one host (the tcp backend's intra-host path).

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
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
NAME_BYTES = 64
"""Size of the frame that carries the arena's file name from rank 0 to the others."""
ALIGN = 64
AUTO_MIN_BYTES = (64 << 10, 256 << 10)
"""Default AXOND_SHM_MIN_BYTES with (not crowded, crowded) cores where the arena's steps synchronize over the sockets
(groups of several nodes, no mailbox); all_reduce on more than two ranks and broadcast
take twice that. Measured on 2 cores, shared memory against sockets: at 2 ranks, reduce_scatter 32 KiB 47 / 43 us,
256 KiB 82 / 129 us; broadcast 32 KiB 32 / 20 us, 256 KiB 50 / 60 us. At 4 ranks, all_reduce 256 KiB 467 / 454 us,
512 KiB 657 / 1022 us; broadcast 256 KiB 262 / 179 us; all_gather 256 KiB 350 / 725 us."""

MAILBOX_SYNC_MIN_BYTES = 4 << 10
"""Default AXOND_SHM_MIN_BYTES of a group whose arena steps synchronize through its mailbox (one node, x86, mailbox
on): every op the mailbox does not take (all_reduce on more than two ranks and broadcast from twice that; broadcast
on a crowded host from 16 times, 64 KiB, as the socket tree's root need not wait for the others). Interleaved A/B on
2 cores, arena against sockets, 8 and 32 KiB: at 2 ranks all_reduce 15-22 / 35-39 us and 23-24 / 40-46 us,
reduce_scatter 22-29 / 29-36 us and 26-28 / 40-44 us; at 4 ranks all_reduce 129-161 / 164-196 us (8 KiB),
reduce_scatter 98-111 / 247-307 us and 74-120 / 248-265 us, all_gather 32 KiB 65-102 / 239-283 us; broadcast at
4 ranks 59-74 / 47-57 us (8 KiB), 51-81 / 51-61 us (16 KiB), 56-88 / 81-88 us (64 KiB)."""


@dataclass(frozen=True)
class ShmTuning:
    """When the tcp backend uses the shared-memory path (environment: AXOND_SHM, AXOND_SHM_*)."""

    enabled: bool = True
    """Use shared memory between ranks on one host (AXOND_SHM=0 sends everything through sockets)."""
    min_bytes: int = -1
    """Ops on at least this many bytes take the shared-memory path, smaller ones stay on sockets (< 0: auto,
    MAILBOX_SYNC_MIN_BYTES or AUTO_MIN_BYTES; all-reduces on more than two ranks, and broadcasts, need twice as
    many)."""
    arena_bytes: int = 32 << 20
    """Size of one group's arena; its slots (2 x (ranks + 1)) are the pipeline chunks of the path."""
    mailbox: bool = True
    """Small ops of a group on one node through its mailbox (see `mailbox`): waits spin, yielding the CPU."""

    @classmethod
    def from_env(cls) -> ShmTuning:
        """Read AXOND_SHM (1/0), AXOND_SHM_MIN_BYTES, AXOND_SHM_ARENA_BYTES and AXOND_SHM_MAILBOX (1/0)."""
        flag = _flag("AXOND_SHM", "1 (shared memory between ranks on one host) or 0 (sockets only)")
        mailbox = _flag("AXOND_SHM_MAILBOX", "1 (small ops through a shared mailbox) or 0 (on the sockets)")
        try:
            tuning = cls(enabled=flag, mailbox=mailbox,
                         min_bytes=int(os.environ.get("AXOND_SHM_MIN_BYTES", cls.min_bytes)),
                         arena_bytes=int(os.environ.get("AXOND_SHM_ARENA_BYTES", cls.arena_bytes)))
        except ValueError as e:
            raise ValueError(f"bad AXOND_SHM_* setting: {e}") from e
        if tuning.arena_bytes < 0:
            raise ValueError("AXOND_SHM_ARENA_BYTES must not be negative")
        return tuning


def _flag(name: str, choices: str) -> bool:
    flag = os.environ.get(name, "1").strip().lower()
    if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{name}={flag!r}: use {choices}")
    return flag in ("1", "true", "yes", "on")


def chunk_bytes(arena_bytes: int, size: int) -> int:
    """Bytes per slot of an arena of about `arena_bytes` for `size` ranks: two buffers of size + 1 slots."""
    per = arena_bytes // (2 * (size + 1))
    return max(ALIGN, min(per, 4 << 20) // ALIGN * ALIGN)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class ShmArena:
    """One group's mapping of the shared file: `slots(buf, dtype, count)` and `result(buf, ...)` views."""

    def __init__(self, path: str, size: int, chunk: int, create: bool) -> None:
        self.path, self.size, self.chunk = path, size, chunk
        nbytes = 2 * (size + 1) * chunk
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
        self._bytes = np.frombuffer(self._map, np.uint8).reshape(2, size + 1, chunk)
        self.turn = 0
        """Which buffer the next step uses; every member flips it at the same steps."""

    @classmethod
    def create(cls, size: int, arena_bytes: int) -> ShmArena:
        path = os.path.join(SHM_DIR, f"axond-{os.getpid()}-{secrets.token_hex(12)}")
        return cls(path, size, chunk_bytes(arena_bytes, size), create=True)

    @classmethod
    def attach(cls, name: np.ndarray, size: int, arena_bytes: int) -> ShmArena:
        """Map the arena whose file name rank 0 sent (`name`, NUL-padded); raises OSError/ValueError if absent."""
        base = bytes(name).rstrip(b"\0").decode()
        if not base.startswith("axond-") or "/" in base:
            raise ValueError(f"not an axond arena name: {base!r}")
        return cls(os.path.join(SHM_DIR, base), size, chunk_bytes(arena_bytes, size), create=False)

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
