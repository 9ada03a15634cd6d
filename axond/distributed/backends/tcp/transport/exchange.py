"""Frames swapped with several peers at once from one thread: non-blocking writes and reads over every socket,
polling only when none can progress, so no send waits for a sender thread (see `FramedGroup.exchange`)."""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from axond.distributed.backends.tcp.transport.peer import Peer, PeerTimeout
from axond.distributed.backends.tcp.transport.sockets import RECV_WAKEUP
from axond.distributed.backends.tcp.transport.wire import HEADER, HEADER_SIZE

if TYPE_CHECKING:
    from axond.distributed.backends.tcp.transport.framing import Call, FramedGroup


class Swap:
    """One peer's part of an exchange: a frame to write and one to read, both through the peer's non-blocking calls."""

    def __init__(self, peer: Peer, header: bytes | None, payload: memoryview | None, view: memoryview | None,
                 check: Callable[[tuple[int, ...]], bool] | None) -> None:
        self.peer = peer
        self.out = [memoryview(header), payload] if header is not None and payload is not None else []
        self.out_left = sum(b.nbytes for b in self.out)
        self.view = view
        self.check = check
        self.hdr = memoryview(bytearray(HEADER_SIZE))
        self.in_total = HEADER_SIZE + view.nbytes if view is not None else 0
        self.got = 0
        self.registered = False

    @property
    def done(self) -> bool:
        return self.out_left == 0 and self.got == self.in_total

    def events(self) -> int:
        return (select.POLLOUT if self.out_left else 0) | (select.POLLIN if self.got < self.in_total else 0)

    def step(self) -> bool:
        """Write and read what the socket takes and has right now; whether anything moved."""
        moved = False
        if self.out_left:
            n = self.peer.send_some(self.out)
            if n:
                moved, self.out_left = True, self.out_left - n
                while self.out and n >= self.out[0].nbytes:
                    n -= self.out.pop(0).nbytes
                if n:
                    self.out[0] = self.out[0][n:]
        if self.got < self.in_total:
            got = self.got
            if got < HEADER_SIZE:
                n = self.peer.recv_some(self.hdr[got:])
            else:
                assert self.view is not None
                n = self.peer.recv_some(self.view[got - HEADER_SIZE :])
            if not n:
                return moved
            self.got = got + n
            if got < HEADER_SIZE <= self.got and self.check is not None and not self.check(HEADER.unpack(self.hdr)):
                self.got = 0  # a point-to-point frame the peer sent first, set aside: read the next header
            moved = True
        return moved


def exchange(g: FramedGroup, c: Call, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
    """Send one frame of call `c` to each peer of `sends` and receive one from each of `recvs`, from this thread."""
    swaps = [Swap(g.peers[p], g.header(c, sends[p].nbytes) if p in sends else None, sends.get(p),
                  recvs.get(p), g.checker(c, p, recvs[p].nbytes) if p in recvs else None)
             for p in sorted(set(sends) | set(recvs))]
    poller = select.poll()
    taken: list[Swap] = []
    try:
        for sw in swaps:  # no frame of another thread's send may start (or be half-written) while this one writes
            sw.peer.acquire_writer(c.deadline)
            taken.append(sw)
    except BaseException:
        for sw in taken:
            sw.peer.write_lock.release()
        raise
    try:
        while True:
            moved = pending = False
            for sw in swaps:
                if not sw.done:
                    moved |= sw.step()
                    pending |= not sw.done
            if not pending:
                return
            if moved:
                continue
            left = c.deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"exchange with peer {swaps[0].peer.rank} stalled", swaps[0].peer.rank)
            for sw in swaps:
                if not sw.done:
                    poller.register(sw.peer.fileno(), sw.events())
                    sw.registered = True
                elif sw.registered:
                    poller.unregister(sw.peer.fileno())
                    sw.registered = False
            if not poller.poll(min(left, RECV_WAKEUP) * 1000):
                g.on_idle()
    finally:
        for sw in swaps:
            sw.peer.write_lock.release()
