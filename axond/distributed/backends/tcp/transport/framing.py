"""The shared template of the TCP backend: calls, framed sends/receives, checks, failure and abort.

Every op runs inside `FramedGroup.run`, which maps transport failures to `DistributedError`
naming the op, the group, this rank and the peer, and tells every peer that this rank gave up so
that all ranks raise instead of waiting for a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import numpy as np

from axond.distributed.backends.tcp.transport.exchange import exchange
from axond.distributed.backends.tcp.policy import SMALL_FRAME
from axond.distributed.backends.tcp.transport.peer import Peer, PeerClosed, PeerError, PeerTimeout
from axond.distributed.backends.tcp.transport.sockets import retransmitting
from axond.distributed.backends.tcp.transport.mismatch import unexpected, unmatched
from axond.distributed.backends.tcp.transport.wire import HEADER, HEADER_SIZE, OP_NAMES, Kind, Op
from axond.errors import DistributedError

T = TypeVar("T")
MAX_ABORT_REASON = 4096
FAILED = 1
"""The reduce-op field of an abort frame sent because the rank's process failed: its reason is the root cause."""


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
        self.expect = (kind, op, dtype, redop, seq, gid, aux, count)


def byte_view(a: np.ndarray) -> memoryview:
    """Writable flat byte view of a C-contiguous array (no copy)."""
    try:
        return memoryview(a).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError, NotImplementedError):
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
        self._root_cause: str | None = None
        self._interrupted: str | None = None
        """Why `interrupt` ended the group (its sockets' failures say this rather than "peer closed")."""
        self._op_name = "init"
        self.explain: Callable[[int], str] | None = None
        """Says what a silent peer is doing, for timeout messages (see `Backend.explain_timeouts`)."""
        self.ranks: list[int] | None = None
        """For a `subset`: the group rank of each of its peer indices (messages name group ranks)."""
        self.current: Call | None = None
        """The call this member started last: the one it runs while it waits."""
        self._current_thread = 0
        self._watch: Callable[[Call], None] | None = None

    def watch(self, check: Callable[[Call], None]) -> None:
        """Have the waits of the current call on the sockets (each receive, send and exchange) run `check(call)`
        whenever they wake up without progress, every RECV_WAKEUP: it may raise to end the wait (see `mailbox`).
        Only in the thread that runs the call: another thread waiting for an isend does not run it."""
        self._watch = check
        for peer in self.peers.values():
            peer.idle = self.on_idle

    def on_idle(self) -> None:
        if self._watch is not None and self.current is not None and threading.get_ident() == self._current_thread:
            self._watch(self.current)

    def subset(self, members: list[int]) -> FramedGroup:
        """The same sockets seen as a smaller group: peer i is group rank members[i] (this rank is among them).

        Ops on it run inside an op of this group (same calls and headers; a failure aborts this group)."""
        sub = FramedGroup(self._rank, self._size, self._group_name, self._gid, self._timeout,
                          {i: self.peers[m] for i, m in enumerate(members) if m != self._rank})
        sub.ranks, sub.explain = list(members), self.explain
        return sub

    def _label(self, peer: int) -> int:
        return peer if self.ranks is None else self.ranks[peer]

    def where(self, op_name: str) -> str:
        return f"{op_name} on group '{self._group_name}' (rank {self._rank} of {self._size})"

    def call(self, op: Op, kind: Kind, dtype: int, redop: int, seq: int, aux: int, count: int) -> Call:
        if self._aborted is not None:
            self.posted_call(op, kind, dtype, redop, seq, aux, count)  # raises
        self._op_name = OP_NAMES[op]
        self._current_thread = threading.get_ident()
        c = self.current = Call(op, kind, dtype, redop, seq & 0xFFFFFFFF, aux, count, time.monotonic() + self._timeout,
                                self._gid)
        return c

    def posted_call(self, op: Op, kind: Kind, dtype: int, redop: int, seq: int, aux: int, count: int) -> Call:
        """A `Call` that does not become the group's current one: for a send posted beside the running op (possibly
        from another thread), which must not take over that op's wait watch (`on_idle`)."""
        if self._aborted is not None:
            raise DistributedError(
                f"{self.where(OP_NAMES[op])}: the group was aborted by an earlier failure ({self._aborted}); "
                "destroy it and create a new group", op=OP_NAMES[op], group=self._group_name, rank=self._rank,
                root_cause=self._root_cause)
        return Call(op, kind, dtype, redop, seq & 0xFFFFFFFF, aux, count, time.monotonic() + self._timeout, self._gid)

    def run(self, op_name: str, fn: Callable[..., T], *args: object) -> T:
        """Run one op body, turning any transport failure into `DistributedError` and aborting the group."""
        try:
            return fn(*args)
        except (DistributedError, PeerError) as e:
            self.failed(op_name, e)

    def failed(self, op_name: str, e: DistributedError | PeerError) -> NoReturn:
        """`run`'s handling of a failure of op `op_name`: abort the group (telling every peer) and raise
        `DistributedError` (`e` itself if it is one)."""
        if isinstance(e, DistributedError):
            if e.root_cause is not None:
                self.abort(e.root_cause, failed=True)  # peers learn the root cause, not this rank's view of it
            else:
                self.abort(str(e))
            raise e
        where = self.where(op_name)
        left = self._abort_left_by(e.peer) if isinstance(e, PeerClosed) else None
        if left is not None:  # the peer said why before it closed (this rank was sending, not reading)
            reason, failed = left
            root = reason if failed else None
            msg = f"{where}: {reason}" if failed else f"{where}: peer rank {e.peer} gave up: {reason}"
            self.abort(root or msg, failed=failed)
            raise DistributedError(msg, op=op_name, group=self._group_name, rank=self._rank, peer=e.peer,
                                   root_cause=root) from e
        if self._interrupted is not None:
            msg = f"{where}: interrupted: {self._interrupted}"
        elif isinstance(e, PeerClosed):
            msg = f"{where}: peer rank {e.peer} closed the connection (did it die?)"
        else:
            msg = f"{where}: timed out after {self._timeout:.1f} s waiting for peer {e.peer}"
            link = next((retransmitting(p.sock) for p in self.peers.values() if p.rank == e.peer), None)
            if link is not None:
                msg += f"; {link}"
            if self.explain is not None:
                msg += f"; {self.explain(e.peer)}"
        self.abort(msg)
        raise DistributedError(msg, op=op_name, group=self._group_name, rank=self._rank, peer=e.peer,
                               timed_out=not isinstance(e, PeerClosed)) from e

    def _abort_left_by(self, peer: int) -> tuple[str, bool] | None:
        """(reason, failed) of an abort frame that peer `peer` (group rank) sent before its connection failed, if
        it is the next thing unread on the socket; never blocks."""
        for p in self.peers.values():
            if p.rank != peer:
                continue
            data = p.peek(HEADER_SIZE + MAX_ABORT_REASON)
            if len(data) < HEADER_SIZE:
                return None
            h = HEADER.unpack_from(data)
            if h[0] != Kind.ABORT or h[1] != Op.ABORT or h[5] != self._gid or len(data) < HEADER_SIZE + h[8]:
                return None
            return data[HEADER_SIZE : HEADER_SIZE + h[8]].decode(errors="replace"), h[3] == FAILED
        return None

    def resized(self, c: Call, count: int, aux: int) -> Call:
        """`c` for one block of an op whose blocks differ per peer (all_to_all with split sizes)."""
        return Call(c.op, c.kind, c.dtype, c.redop, c.seq, aux, count, c.deadline, self._gid)

    def header(self, c: Call, nbytes: int) -> bytes:
        """The frame header of a `nbytes` payload of call `c` (pack once, send it to several peers)."""
        return HEADER.pack(c.kind, c.op, c.dtype, c.redop, c.seq, self._gid, c.aux, c.count, nbytes)

    def send(self, c: Call, peer: int, payload: memoryview) -> int:
        header = HEADER.pack(c.kind, c.op, c.dtype, c.redop, c.seq, self._gid, c.aux, c.count, payload.nbytes)
        return self.peers[peer].send(header, payload)

    def wait_sent(self, c: Call, peer: int, ticket: int) -> None:
        self.peers[peer].wait_sent(ticket, c.deadline)

    def flush(self, c: Call, *peers: int) -> None:
        for p in peers or tuple(self.peers):
            self.peers[p].flush(c.deadline)

    def recv(self, c: Call, peer: int, view: memoryview) -> None:
        """Receive the next frame from `peer` into `view`, checking that it belongs to the same op.

        A collective sets aside the point-to-point frames that came before its own (the peer sent them first); a
        point-to-point receive takes those first (see `Peer.early`)."""
        n = view.nbytes
        p = self.peers[peer]
        if c.kind != Kind.COLLECTIVE and p.early:
            h, data = p.early.popleft()
            if h[:8] != c.expect or h[8] != n:
                self._reject(c, peer, h, n, memoryview(data))
            view[:] = data
            return
        if n <= SMALL_FRAME:
            h, payload = p.recv_small(n, c.deadline, c.kind == Kind.COLLECTIVE)
            if h[:8] != c.expect or h[8] != n:
                self._reject(c, peer, h, n, payload)
            if n:
                view[:] = payload
            return
        self.expect(c, peer, n)
        p.recv_into(view, c.deadline)

    def recv_p2p(self, c: Call, peer: int, view: memoryview) -> None:
        """Receive point-to-point call `c` (its tag in `aux`) from `peer` into `view`: the oldest frame of that tag,
        set aside before (`Peer.early`) or read now; frames of other tags read on the way are set aside, so
        sends and receives match per tag in any order of tags, as gloo's do."""
        n = view.nbytes
        p = self.peers[peer]
        for i, (h, data) in enumerate(p.early):
            if h[0] == Kind.P2P and h[6] == c.aux:
                del p.early[i]
                if h[:8] != c.expect or h[8] != n:
                    self._reject(c, peer, h, n, memoryview(data))
                view[:] = data
                return
        while True:
            try:
                h = p.recv_header(c.deadline)
            except PeerTimeout:
                self._unmatched(c, peer)
                raise
            if h[0] == Kind.P2P and h[6] != c.aux and h[5] == self._gid:
                p.set_aside(h, memoryview(b""), c.deadline)
                continue
            if h[:8] != c.expect or h[8] != n:
                self._reject(c, peer, h, n, memoryview(b""))
            if n:
                p.recv_into(view, c.deadline)
            return

    def _unmatched(self, c: Call, peer: int) -> None:
        """A receive timed out while sends of other tags from `peer` wait unreceived: raise naming both."""
        why = unmatched(c, peer, [h for h, _ in self.peers[peer].early], self._timeout)
        if why is not None:
            error = self.error(c, peer, why)
            error.timed_out = True
            raise error

    def p2p_waiting(self, peer: int, tag: int) -> bool | None:
        """For a receive from any source: whether `peer` has a point-to-point frame of `tag` ready (set aside, or
        next on its socket: True), none yet (False), or something else next (None: a collective's frame or an
        abort, which a receive from that peer would read and report). Never blocks."""
        p = self.peers[peer]
        if any(h[0] == Kind.P2P and h[6] == tag for h, _ in p.early):
            return True
        data = p.peek(HEADER_SIZE)
        if len(data) < HEADER_SIZE:
            return None if data == b"" and p.readable() else False  # readable but nothing to peek: closed
        h = HEADER.unpack_from(data)
        if h[0] != Kind.P2P or h[5] != self._gid:
            return None
        if h[6] == tag:
            return True
        p.set_aside(p.recv_header(time.monotonic() + self._timeout), memoryview(b""), time.monotonic() + self._timeout)
        return self.p2p_waiting(peer, tag)

    def ahead_in_collective(self, peer: int) -> bool:
        """Whether `peer`'s next frame is a collective's of this group: it has moved on to a later collective and
        sends nothing point-to-point before this rank joins it (a receive from any source skips it). Never blocks."""
        data = self.peers[peer].peek(HEADER_SIZE)
        if len(data) < HEADER_SIZE:
            return False
        h = HEADER.unpack_from(data)
        return h[0] == Kind.COLLECTIVE and h[5] == self._gid

    def recv_array(self, c: Call, peer: int, like: np.ndarray) -> np.ndarray:
        """Receive a small frame (<= SMALL_FRAME bytes) shaped like flat `like`, checked against `c`;
        returns it as a view of the peer's receive buffer (no copy), valid until the next receive from `peer`."""
        p, n = self.peers[peer], like.nbytes
        h, payload = p.recv_small(n, c.deadline, c.kind == Kind.COLLECTIVE)
        if h[:8] != c.expect or h[8] != n:
            self._reject(c, peer, h, n, payload)
        return p.small_array(like.dtype, like.size)

    def exchange(self, c: Call, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
        """Send one frame to each peer of `sends` and receive one from each of `recvs`, all from this thread (see
        `exchange.exchange`): no hand-off to sender threads; each received header is checked before its payload."""
        exchange(self, c, sends, recvs)

    def checker(self, c: Call, peer: int, n: int) -> Callable[[tuple[int, ...]], bool]:
        """Check a header from `peer` in an exchange: whether it is the call's frame (False: a point-to-point frame
        the peer sent first, now set aside); anything else raises."""
        def check(h: tuple[int, ...]) -> bool:
            if h[0] == Kind.P2P and c.kind == Kind.COLLECTIVE:
                self.peers[peer].set_aside(h, memoryview(b""), c.deadline)
                return False
            if h[:8] != c.expect or h[8] != n:
                self._reject(c, peer, h, n, memoryview(b""))
            return True
        return check

    def expect(self, c: Call, peer: int, nbytes: int | None) -> int:
        """Receive a header from `peer`, check it against `c` (and its payload size unless None); return the size."""
        h = self.peers[peer].recv_header(c.deadline, c.kind == Kind.COLLECTIVE)
        if h[:8] != c.expect or (nbytes is not None and h[8] != nbytes):
            self._reject(c, peer, h, nbytes, memoryview(b""))
        return int(h[8])

    def only_early(self, c: Call, index: int) -> bool:
        """Read what peer `index` sent while this rank waits outside the sockets in collective `c` (the mailbox):
        set aside point-to-point frames (`Peer.early`) while more are there; whether that was all. Any other frame
        raises (an abort, another call), except one of call `c` itself, whose header is read: False."""
        p = self.peers[index]
        while True:
            h = p.recv_header(c.deadline)
            if h[0] != Kind.P2P:
                if h[:8] != c.expect:
                    self._reject(c, index, h, None, memoryview(b""))
                return False
            p.set_aside(h, memoryview(b""), c.deadline)
            if not p.readable():
                return True

    def reject(self, c: Call, index: int, h: tuple[int, ...], nbytes: int | None) -> NoReturn:
        """Raise the error for header `h` (the 9 fields of a frame header) that peer `index` posted for call `c`."""
        self._reject(c, index, h, nbytes, memoryview(b""))

    def _reject(self, c: Call, index: int, h: tuple[int, ...], nbytes: int | None, early: memoryview) -> NoReturn:
        """Raise the error for an unexpected frame from peer `index`: an abort from it, or a mismatched call."""
        peer = self._label(index)
        if h[0] == Kind.ABORT:
            n = min(int(h[8]), MAX_ABORT_REASON)
            buf = bytearray(early[:n])
            if len(buf) < n:
                rest = bytearray(n - len(buf))
                try:
                    self.peers[index].recv_into(memoryview(rest), time.monotonic() + 1.0)
                except PeerError:
                    pass
                buf += rest
            reason = buf.decode(errors="replace")
            if h[3] == FAILED:
                raise self.error(c, peer, reason, root_cause=reason)
            raise self.error(c, peer, f"peer rank {peer} gave up: {reason}")
        raise self.error(c, peer, unexpected(c, peer, h, nbytes, self._gid))

    def error(self, c: Call, peer: int | None, what: str, root_cause: str | None = None) -> DistributedError:
        """The error of call `c` about `peer` (a group rank; None: no single peer)."""
        name = OP_NAMES[c.op]
        return DistributedError(f"{self.where(name)}: {what}", op=name, group=self._group_name,
                                rank=self._rank, peer=peer, root_cause=root_cause)

    def abort(self, reason: str, failed: bool = False) -> None:
        """Tell every peer this rank gives up (they raise too), then shut the links down; idempotent.

        `failed`: `reason` is the root cause of the failure ("rank R failed: ExcType: message"), which
        peers report as it is instead of as "peer rank R gave up: ...".
        """
        if self._aborted is not None:
            return
        self._aborted = reason
        self._root_cause = reason if failed else None
        data = reason.encode()[:MAX_ABORT_REASON]
        frame = HEADER.pack(Kind.ABORT, Op.ABORT, 0, FAILED if failed else 0, 0, self._gid, self._rank, 0,
                            len(data)) + data
        for peer in self.peers.values():
            peer.try_send_now(frame)
            peer.shutdown_write()

    def interrupt(self, reason: str) -> None:
        """`abort(reason)` from another thread, then shut every socket down both ways: a wait on a peer that never
        answers (its link cut, no FIN or reset to come) wakes at once, and the op fails quoting `reason`."""
        self.abort(reason)
        self._interrupted = self._aborted
        for peer in list(self.peers.values()):
            peer.shutdown()

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def close_peers(self) -> None:
        if self._aborted is None:
            self._aborted = "the group was destroyed"
        for peer in self.peers.values():
            peer.close()
        self.peers = {}
