"""The single-copy path of ranks on one host: a rank reads its peers' buffers straight into its own with
`process_vm_readv` (Linux cross-memory attach, MPI's CMA path), so each byte is copied once where the arena copies
it twice (into a slot, out of it).

Per op every rank publishes (pid, address, bytes) of its contiguous buffer to the others (`SingleCopy.publish`:
through the group's mailbox where it is mapped, else a small framed all_gather over the sockets; either way the
op's header is compared, so a peer in another call raises on every rank), reads what it needs from its peers
(`single_copy_ops`), and ends with a synchronization (`SingleCopy.done`) so that no owner reuses or frees a buffer
while a peer still reads it. A read of a peer that died or freed its buffer fails with an errno (never a fault):
the op raises `DistributedError` and the group aborts.

The kernel copies 7-8x slower when the destination starts 1-31 bytes after the source modulo the page (AMD's
`rep movsb`, see `host_copy`), so such a read goes through a bounce buffer at half a page from the source instead
(two fast copies: a 1 MiB read takes ~120 us that way against ~585 straight).

Where the mailbox is mapped and every member runs the compiled ops, a prepared broadcast or all_gather runs all of
this in one C call (`_fastbox`, the same protocol; `single_copy_ops.PreparedBroadcast`); the policy sends some
sizes below SINGLE_COPY_MIN_BYTES to the path only in that form (`policy.needs_compiled`).

Availability is decided once per group (`set_up`) and agreed by every member (a MIN): the system call exists, Yama's
ptrace_scope allows it (1: this process first lets any process of its user read it, `PR_SET_PTRACER_ANY`; 2 or 3:
not available) and a test read of every peer works (ranks that are threads of one process read their own pid).
Otherwise the group's large ops take the arena. With AXOND_DEBUG=1 each rank prints which path its group uses.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys

import numpy as np

from axond.distributed.diagnostics import failure
from axond.distributed.backends.tcp.policy import BOUNCE_BYTES, BOUNCE_MIN_BYTES
from axond.distributed.backends.host_copy import PAGE, address, copy, large_copy, slow_distance
from axond.distributed.backends.tcp.schedules import direct
from axond.distributed.backends.tcp.schedules.group_view import GroupView
from axond.distributed.backends.tcp.shm.arena_ops import Sync
from axond.distributed.backends.shared_arrays import Mappings, find
from axond.distributed.backends.tcp.transport.framing import Call

YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
WORDS = 6
"""Published per buffer: pid, address, bytes, and for an array from `shared_empty` its memfd, token and offset in
the segment (memfd -1 for other arrays)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                      ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    return libc


LIBC = _libc()


class Reader:
    """`process_vm_readv` with its two iovecs built once (the GIL is released during the call)."""

    def __init__(self) -> None:
        assert LIBC is not None
        self._readv = LIBC.process_vm_readv
        self._local, self._remote = _IoVec(), _IoVec()
        self._local_ref, self._remote_ref = ctypes.byref(self._local), ctypes.byref(self._remote)
        self._bounce: np.ndarray | None = None

    def read(self, pid: int, remote: int, dest: np.ndarray) -> None:
        """dest (C-contiguous) <- its size in bytes from `remote` in process `pid`; OSError (its errno) if not."""
        base = address(dest)
        if dest.nbytes >= BOUNCE_MIN_BYTES and slow_distance(base, remote):
            self._bounced(pid, remote, dest.reshape(-1).view(np.uint8))
        else:
            self._read(pid, remote, base, dest.nbytes)

    def _read(self, pid: int, remote: int, base: int, want: int) -> None:
        done = 0
        while done < want:
            self._local.base, self._local.len = base + done, want - done
            self._remote.base, self._remote.len = remote + done, want - done
            got = self._readv(pid, self._local_ref, 1, self._remote_ref, 1, 0)
            if got <= 0:
                code = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise OSError(code, os.strerror(code))
            done += got

    def _bounced(self, pid: int, remote: int, dest: np.ndarray) -> None:
        """`read` at a slow distance: into the bounce buffer half a page from the source, then into `dest`."""
        if self._bounce is None:
            self._bounce = np.empty(BOUNCE_BYTES + PAGE, np.uint8)
        start = (remote + PAGE // 2 - address(self._bounce)) % PAGE
        for s in range(0, dest.size, BOUNCE_BYTES):
            m = min(BOUNCE_BYTES, dest.size - s)
            bounce = self._bounce[start : start + m]
            self._read(pid, remote + s, address(bounce), m)
            copy(dest[s : s + m], bounce)


def yama_scope(path: str = YAMA_SCOPE) -> int | None:
    """Yama's ptrace_scope (None: no Yama)."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def local_obstacle(scope_path: str = YAMA_SCOPE) -> str | None:
    """Why this process cannot use the path, as far as it can tell alone (None: nothing known against it)."""
    if LIBC is None:
        return "no process_vm_readv on this platform"
    scope = yama_scope(scope_path)
    if scope is not None and scope > 1:
        return f"Yama ptrace_scope is {scope} ({scope_path})"
    if scope == 1 and LIBC.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        code = ctypes.get_errno()
        return f"Yama ptrace_scope is 1 and prctl(PR_SET_PTRACER) failed: {os.strerror(code)}"
    probe = np.arange(2, dtype=np.int64)
    try:
        Reader().read(os.getpid(), address(probe), np.empty(2, np.int64))
    except OSError as e:
        return f"process_vm_readv fails: {e.strerror}"
    return None


class SingleCopy:
    """A group's single-copy path, set up: publishes this rank's buffer of an op, reads peers', synchronizes."""

    def __init__(self, comm: GroupView, sync: Sync, compiled: bool = False) -> None:
        self.comm, self.sync = comm, sync
        self.compiled = compiled
        """Whether every member runs the compiled single-copy ops (`_fastbox`, through the mailbox): agreed by all
        (`set_up`), so
        the ops that take the path only in that form (`policy.needs_compiled`) take it on every member or on none."""
        self.reader = Reader()
        self.pid = os.getpid()
        self.mappings = Mappings()
        self._words = np.zeros(WORDS, np.int64)

    def publish(self, c: Call, buffer: np.ndarray) -> np.ndarray:
        """(size, WORDS) int64: every member's (pid, address, bytes, memfd, token, offset) of its buffer for call `c`
        (a synchronization)."""
        base = address(buffer)
        shared = find(base, buffer.nbytes)
        self._words[:] = (self.pid, base, buffer.nbytes, *(shared or (-1, 0, 0)))
        return exchange(self.comm, self.sync, c, self._words)

    def _check(self, c: Call, table: np.ndarray, peer: int, offset: int, nbytes: int) -> None:
        if offset + nbytes > int(table[peer, 2]):
            raise self.comm.g.error(c, peer, f"peer rank {peer} published {int(table[peer, 2])} bytes, this rank "
                                             f"reads {offset + nbytes}")

    def view(self, c: Call, table: np.ndarray, peer: int, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes offset..offset+nbytes of peer `peer`'s buffer mapped read-only, if the peer's buffer is an array
        from `shared_empty` that this rank can map; else None (read it with `read`)."""
        self._check(c, table, peer, offset, nbytes)
        pid, _, _, fd, token, start = (int(v) for v in table[peer])
        if fd < 0 or start < 0:
            return None
        mapped = self.mappings.view(pid, fd, token, start + offset + nbytes)
        return None if mapped is None else mapped[start + offset : start + offset + nbytes]

    def read(self, c: Call, table: np.ndarray, peer: int, offset: int, dest: np.ndarray) -> None:
        """dest <- peer `peer`'s buffer (`table` from `publish`) from byte `offset`; raises `DistributedError`
        naming the peer if it cannot be read (it died or gave up) or is smaller than asked. A buffer from
        `shared_empty` is copied from its mapping, any other through the kernel."""
        source = self.view(c, table, peer, offset, dest.nbytes)
        if source is not None:
            large_copy(dest.reshape(-1).view(np.uint8), source)
            return
        pid, base = int(table[peer, 0]), int(table[peer, 1])
        try:
            self.reader.read(pid, base + offset, dest)
        except OSError as e:
            raise self.comm.g.error(c, peer, f"reading peer rank {peer}'s buffer (pid {pid}) failed: "
                                             f"{e.strerror} (did it die?)") from e

    def done(self, c: Call) -> None:
        """The op's last synchronization: every member finished reading every buffer."""
        self.sync(c)


def exchange(comm: GroupView, sync: Sync, c: Call, words: np.ndarray) -> np.ndarray:
    """Every member's `words` (int64), gathered through the mailbox where it is mapped, else over the sockets."""
    box = sync.mailbox
    if box is not None:
        return box.payloads(box.post(c, words), words.dtype, words.size).copy()
    table = np.empty((comm.size, words.size), np.int64)
    table[comm.rank] = words
    direct.direct_all_gather(comm, c, table)
    return table


def set_up(comm: GroupView, sync: Sync, c: Call, scope_path: str = YAMA_SCOPE) -> SingleCopy | None:
    """The single-copy path if every member can read every other's memory (agreed by all), else None for all.
    Each member publishes a random token and reads every peer's."""
    obstacle = local_obstacle(scope_path)
    token = np.array([secrets.randbits(62)], np.int64)
    compiled = sync.mailbox is not None and sync.mailbox.native is not None
    words = np.array([os.getpid(), address(token), token.nbytes, obstacle is None, int(token[0]), compiled], np.int64)
    table = exchange(comm, sync, c, words)
    if obstacle is None and not table[:, 3].all():
        obstacle = "a peer cannot use it"
    if obstacle is None:
        reader, got = Reader(), np.zeros(1, np.int64)
        for p in range(comm.size):
            try:
                reader.read(int(table[p, 0]), int(table[p, 1]), got)
            except OSError as e:
                obstacle = f"reading peer rank {p} (pid {table[p, 0]}) fails: {e.strerror}"
                break
            if got[0] != table[p, 4]:
                obstacle = f"reading peer rank {p} (pid {table[p, 0]}) returns other bytes"
                break
    agreed = exchange(comm, sync, c, np.array([obstacle is None], np.int64))  # also: every read of `token` is done
    if obstacle is None and not agreed.all():
        obstacle = "a peer cannot read this rank or another"
    if failure.debug():
        which = "the single-copy path (process_vm_readv)" if obstacle is None else f"the arena ({obstacle})"
        print(f"axond: {comm.g.where('set-up')}: large ops on one host take {which}", file=sys.stderr, flush=True)
    return SingleCopy(comm, sync, bool(table[:, 5].all())) if obstacle is None else None
