"""The shared template of the TCP backend: calls, framed sends/receives, checks, failure and abort.

Every op runs inside `FramedGroup.run`, which maps transport failures to `DistributedError`
naming the op, the group, this rank and the peer, and tells every peer that this rank gave up so
that all ranks raise instead of waiting for a timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, TypeVar

import numpy as np

from axond.distributed.peer import SMALL_FRAME, Peer, PeerClosed, PeerError
from axond.distributed.wire import HEADER, OP_NAMES, Kind, Op, describe
from axond.errors import DistributedError

T = TypeVar("T")
MAX_ABORT_REASON = 4096


@dataclass(frozen=True)
class TcpTuning:
    """Algorithm thresholds of the TCP backend (environment: AXOND_TCP_*)."""

    small_bytes: int = 128 << 10
    """All-reduce/broadcast up to this size use latency-optimal trees; above, pipelined rings/chains."""
    chunk_bytes: int = 0
    """Pipeline chunk size (0: a quarter of a block, clamped to 64 KiB..1 MiB)."""
    spin_us: float = 50.0
    """Microseconds a small receive busy-polls before blocking (0 disables)."""
    inline_bytes: int = 256 << 10
    """Frames up to this size are first sent without blocking from the op's thread (no hand-off)."""
    algorithm: Literal["ring", "halving_doubling"] = "ring"
    """Large all-reduce: pipelined ring, or halving-doubling (Rabenseifner) on power-of-two groups."""
    spin_yield: bool = True
    """Yield the CPU between polls (helps when ranks outnumber cores)."""

    @classmethod
    def from_env(cls) -> TcpTuning:
        """Read AXOND_TCP_SMALL_BYTES, _CHUNK_BYTES, _SPIN_US, _SPIN_YIELD, _INLINE_BYTES and _ALGORITHM."""
        try:
            return cls(
                small_bytes=int(os.environ.get("AXOND_TCP_SMALL_BYTES", cls.small_bytes)),
                chunk_bytes=int(os.environ.get("AXOND_TCP_CHUNK_BYTES", cls.chunk_bytes)),
                spin_us=float(os.environ.get("AXOND_TCP_SPIN_US", cls.spin_us)),
                spin_yield=os.environ.get("AXOND_TCP_SPIN_YIELD", "1") != "0",
                inline_bytes=int(os.environ.get("AXOND_TCP_INLINE_BYTES", cls.inline_bytes)),
                algorithm="halving_doubling" if os.environ.get("AXOND_TCP_ALGORITHM") == "halving_doubling" else "ring",
            )
        except ValueError as e:
            raise ValueError(f"bad AXOND_TCP_* setting: {e}") from e


class Call:
    """One running operation: what goes into every frame header and what every received one must match."""

    __slots__ = ("op", "kind", "dtype", "redop", "seq", "aux", "count", "deadline", "expect")

    def __init__(self, op: Op, kind: Kind, dtype: int, redop: int, seq: int, aux: int, count: int,
                 deadline: float, gid: int) -> None:
        self.op = op
        self.kind = kind
        self.dtype = dtype
        self.redop = redop
        self.seq = seq
        self.aux = aux
        self.count = count
        self.deadline = deadline
        self.expect = (int(kind), int(op), dtype, redop, seq, gid, aux, count)


def byte_view(a: np.ndarray) -> memoryview:
    """Writable flat byte view of a C-contiguous array (no copy)."""
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class FramedGroup:
    """Peers of one group member plus the framing, checking and abort logic shared by every op."""

    def __init__(self, rank: int, size: int, group_name: str, gid: int, timeout: float,
                 peers: dict[int, Peer]) -> None:
        self._rank = rank
        self._size = size
        self._group_name = group_name
        self._gid = gid
        self._timeout = timeout
        self.peers = peers
        self._aborted: str | None = None
        self._op_name = "init"

    def where(self, op_name: str) -> str:
        return f"{op_name} on group '{self._group_name}' (rank {self._rank} of {self._size})"

    def call(self, op: Op, kind: Kind, dtype: int, redop: int, seq: int, aux: int, count: int) -> Call:
        if self._aborted is not None:
            raise DistributedError(
                f"{self.where(OP_NAMES[op])}: the group was aborted by an earlier failure ({self._aborted}); "
                "destroy it and create a new group", op=OP_NAMES[op], group=self._group_name, rank=self._rank)
        self._op_name = OP_NAMES[op]
        return Call(op, kind, dtype, redop, seq & 0xFFFFFFFF, aux, count, time.monotonic() + self._timeout, self._gid)

    def run(self, op_name: str, fn: Callable[..., T], *args: object) -> T:
        """Run one op body, turning any transport failure into `DistributedError` and aborting the group."""
        try:
            return fn(*args)
        except DistributedError as e:
            self.abort(str(e))
            raise
        except PeerError as e:
            where = self.where(op_name)
            if isinstance(e, PeerClosed):
                msg = f"{where}: peer rank {e.peer} closed the connection (did it die?)"
            else:
                msg = f"{where}: timed out after {self._timeout:.1f} s waiting for peer {e.peer}"
            self.abort(msg)
            raise DistributedError(msg, op=op_name, group=self._group_name, rank=self._rank, peer=e.peer) from e

    def send(self, c: Call, peer: int, payload: memoryview) -> int:
        header = HEADER.pack(c.kind, c.op, c.dtype, c.redop, c.seq, self._gid, c.aux, c.count, payload.nbytes)
        return self.peers[peer].send(header, payload)

    def wait_sent(self, c: Call, peer: int, ticket: int) -> None:
        self.peers[peer].wait_sent(ticket, c.deadline)

    def flush(self, c: Call, *peers: int) -> None:
        for p in peers or tuple(self.peers):
            self.peers[p].flush(c.deadline)

    def recv(self, c: Call, peer: int, view: memoryview) -> None:
        """Receive the next frame from `peer` into `view`, checking that it belongs to the same op."""
        n = view.nbytes
        if n <= SMALL_FRAME:
            h, payload = self.peers[peer].recv_small(n, c.deadline)
            if h[:8] != c.expect or h[8] != n:
                self._reject(c, peer, h, n, payload)
            if n:
                view[:] = payload
            return
        self.expect(c, peer, n)
        self.peers[peer].recv_into(view, c.deadline)

    def expect(self, c: Call, peer: int, nbytes: int | None) -> int:
        """Receive a header from `peer`, check it against `c` (and its payload size unless None); return the size."""
        h = self.peers[peer].recv_header(c.deadline)
        if h[:8] != c.expect or (nbytes is not None and h[8] != nbytes):
            self._reject(c, peer, h, nbytes, memoryview(b""))
        return int(h[8])

    def _reject(self, c: Call, peer: int, h: tuple[int, ...], nbytes: int | None, early: memoryview) -> NoReturn:
        """Raise the error for an unexpected frame: an abort from the peer, or a mismatched call."""
        if h[0] == Kind.ABORT:
            n = min(int(h[8]), MAX_ABORT_REASON)
            buf = bytearray(early[:n])
            if len(buf) < n:
                rest = bytearray(n - len(buf))
                try:
                    self.peers[peer].recv_into(memoryview(rest), time.monotonic() + 1.0)
                except PeerError:
                    pass
                buf += rest
            raise self.error(c, peer, f"peer rank {peer} gave up: {buf.decode(errors='replace')}")
        mine = describe(c.op, c.dtype, c.count, c.redop, c.aux)
        if h[0] not in (Kind.COLLECTIVE, Kind.P2P) or h[5] != self._gid:
            raise self.error(c, peer, f"peer rank {peer} sent a frame that is not from this group "
                                      f"(kind {h[0]}, group id {h[5]:#x}); the stream is out of step")
        theirs = describe(h[1], h[2], h[7], h[3], h[6])
        if h[:4] + h[5:8] == c.expect[:4] + c.expect[5:8] and (nbytes is None or h[8] == nbytes):
            raise self.error(c, peer, f"peer rank {peer} is at operation #{h[4]} but this rank is at #{c.seq} "
                                      f"(both in {mine}); a rank skipped or added a call")
        if theirs == mine:
            theirs += f" [frame of {h[8]} bytes, expected {nbytes}]"
        raise self.error(c, peer, f"peer rank {peer} called {theirs} but this rank called {mine}")

    def error(self, c: Call, peer: int | None, what: str) -> DistributedError:
        name = OP_NAMES[c.op]
        return DistributedError(f"{self.where(name)}: {what}", op=name, group=self._group_name,
                                rank=self._rank, peer=peer)

    def abort(self, reason: str) -> None:
        """Tell every peer this rank gives up (they raise too), then shut the links down; idempotent."""
        if self._aborted is not None:
            return
        self._aborted = reason
        data = reason.encode()[:MAX_ABORT_REASON]
        frame = HEADER.pack(Kind.ABORT, Op.ABORT, 0, 0, 0, self._gid, self._rank, 0, len(data)) + data
        for peer in self.peers.values():
            peer.try_send_now(frame)
            peer.shutdown_write()

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def close_peers(self) -> None:
        if self._aborted is None:
            self._aborted = "the group was destroyed"
        for peer in self.peers.values():
            peer.close()
        self.peers = {}
