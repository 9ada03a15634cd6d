"""The mpi backend's point-to-point ops (send, recv from a rank or any, isend, `batch_isend_irecv`): `PointToPoint`,
a base of `MpiBackend`, whose helpers (`_array`, `_run`, ...) it uses. Each op is MPI_Isend/MPI_Irecv waited for to
the group's deadline through the group's `Channel`; a receive checks the size the peer sent.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

from axond.distributed.backends.base import P2P, Array, BackendOptions
from axond.distributed.backends.mpi.channel import Channel
from axond.distributed.backends.mpi.library import wire_view
from axond.distributed.work import PendingSend


class PointToPoint:
    """send, recv, recv_any, post_send and batch_p2p of `MpiBackend`."""

    ch: Channel
    MPI: Any
    rank: int
    options: BackendOptions

    def _array(self, x: Any, what: str) -> Any:
        raise NotImplementedError

    def _root(self, root: int, what: str) -> int:
        raise NotImplementedError

    def _run(self, name: str, start: Callable[[], Any], keep: Any, peer: int | None = None,
             status: Any = None) -> None:
        raise NotImplementedError

    @staticmethod
    def _contiguous(x: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _back(x: Any, work: Any) -> None:
        raise NotImplementedError

    def _peer(self, peer: int, what: str) -> int:
        peer = self._root(peer, what)
        if peer == self.rank:
            raise ValueError(f"rank {self.rank} cannot {'send to' if what == 'dst' else 'receive from'} itself")
        return peer

    def _tag(self, tag: int) -> int:
        tag = operator.index(tag)
        top = self.ch.comm.Get_attr(self.MPI.TAG_UB)
        if not 0 <= tag <= top:
            raise ValueError(f"tag {tag} is outside MPI's tags here (0..{top})")
        return tag

    def send(self, x: Array, dst: int, tag: int) -> None:
        sent = self.post_send(x, dst, tag)
        if sent is not None:
            sent.wait(self.options.timeout, True)

    def post_send(self, x: Array, dst: int, tag: int) -> PendingSend | None:
        """Start the send and return at once: the `PendingSend` completes when MPI is done with the buffer."""
        x = self._array(x, "send input")
        dst, tag = self._peer(dst, "dst"), self._tag(tag)
        self.ch.enter("send")
        buf = wire_view(self._contiguous(x).reshape(-1))
        try:
            request = self.ch.comm.Isend(buf, dst, tag)
        except self.MPI.Exception as e:
            raise self.ch.fail("send", dst, f"MPI error: {e.Get_error_string()}") from e

        def wait(timeout: float, strict: bool) -> bool:
            if strict:
                self._run("send", lambda: request, buf, peer=dst)
                return True
            deadline = time.monotonic() + timeout
            while not request.Test():
                if time.monotonic() > deadline:
                    return False
            return True
        return PendingSend(lambda: bool(request.Test()), wait)

    def _receive(self, x: Array, src: int, tag: int) -> int:
        x = self._array(x, "recv buffer")
        self.ch.enter("recv")
        work = self._contiguous(x)
        buf = wire_view(work.reshape(-1))
        status = self.MPI.Status()
        peer = None if src == self.MPI.ANY_SOURCE else src
        self._run("recv", lambda: self.ch.comm.Irecv(buf, src, tag), buf, peer=peer, status=status)
        source = status.Get_source()
        got = status.Get_count(self.MPI.BYTE)
        if got != x.nbytes:
            raise self.ch.fail("recv", source, f"peer rank {source} sent {got} bytes with tag {tag} but this rank "
                                               f"receives {x.nbytes} ({x.dtype} {tuple(x.shape)})")
        self._back(x, work)
        return int(source)

    def recv(self, x: Array, src: int, tag: int) -> None:
        self._receive(x, self._peer(src, "src"), self._tag(tag))

    def recv_any(self, x: Array, tag: int) -> int:
        return self._receive(x, self.MPI.ANY_SOURCE, self._tag(tag))

    def batch_p2p(self, batch: list[P2P]) -> None:
        """Start every isend and irecv of `batch` at once and wait for them all (no order of them can deadlock)."""
        self.ch.enter("batch_p2p")
        requests, keep, back = [], [], []
        for kind, x, peer, tag in batch:
            x = self._array(x, f"batch_isend_irecv {kind}")
            peer, tag = self._peer(peer, "dst" if kind == "isend" else "src"), self._tag(tag)
            work = self._contiguous(x)
            buf = wire_view(work.reshape(-1))
            keep.append(buf)
            if kind == "isend":
                requests.append(self.ch.comm.Isend(buf, peer, tag))
            else:
                requests.append(self.ch.comm.Irecv(buf, peer, tag))
                back.append((x, work))
        try:
            self.ch.wait(requests, "batch_p2p", keep=keep)
        except self.MPI.Exception as e:
            raise self.ch.fail("batch_p2p", None, f"MPI error: {e.Get_error_string()}") from e
        for x, work in back:
            self._back(x, work)
