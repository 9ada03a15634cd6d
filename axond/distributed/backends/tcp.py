"""The TCP backend: a full mesh of authenticated sockets, with gloo/NCCL-style algorithms chosen by size.

This file checks arguments and keeps per-op bookkeeping (sequence numbers, frame headers);
the schedules live in `tcp_algorithms`. Data moves straight from and into the arrays' buffers
and reductions run in place with NumPy ufuncs. When every member is on this host, small ops go
through a shared-memory mailbox (`mailbox`) and large all_reduce, broadcast, all_gather and
reduce_scatter through a shared-memory arena (`shm_algorithms`), with the sockets carrying only the
framed synchronizations; a group spread over nodes with several members on each runs large ops in
two levels (`shm_plan`, `two_level`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.backends.base import Array, Backend, BackendOptions
from axond.distributed import low_precision, two_level
from axond.distributed.backends.host_arrays import numpy_array, output_array, scatter_rows
from axond.distributed.framing import Call, FramedGroup, TcpTuning, byte_view
from axond.distributed.mailbox import Mailbox, MailboxAlgorithms
from axond.distributed.mesh import Mesh
from axond.distributed.peer import (
    AUTO_INLINE_BYTES, AUTO_SPIN_SECONDS, Peer, PeerError, PeerTimeout, oversubscribed,
)
from axond.distributed.reduce_op import ReduceOp
from axond.distributed.reducers import check_reduce_op, finish_average
from axond.distributed.shm import ShmArena, ShmTuning
from axond.distributed.shm_algorithms import ShmAlgorithms
from axond.distributed.shm_plan import ShmPlan
from axond.distributed.splits import check_splits, offsets
from axond.distributed.tcp_algorithms import TcpAlgorithms
from axond.distributed.team import Team
from axond.distributed.topology import Topology
from axond.distributed.work import PendingSend
from axond.distributed.wire import (
    DTYPE_CODE, DTYPES, REDUCE_CODES, UNEVEN_ALL_TO_ALL, Kind, Op, dtype_code, group_id, uneven_aux,
)
from axond.store import Store

SCRATCH_VIEWS = 64
"""Typed views of the receive buffer kept for reuse (small ops ask for the same few every call)."""
META = 34
"""Max int64 words of a scatter metadata frame: dtype code, ndim, up to 32 dims."""


def _numpy(x: Any, what: str) -> np.ndarray:
    return numpy_array(x, what, "tcp")


class TcpBackend(TcpAlgorithms, ShmAlgorithms, MailboxAlgorithms, ShmPlan, Backend):
    """Collectives over TCP sockets between the ranks of one group."""

    name = "tcp"

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        super().__init__(store, rank, size, group_name, options)
        self.tuning = TcpTuning.from_env()
        gid = group_id(group_name)
        where = f"group '{group_name}' (rank {rank} of {size})"
        socks = {}
        self.host = ""
        if size > 1:
            mesh = Mesh(store, rank, size, gid, options.job_secret, options.host, options.port, options.timeout, where,
                        options.handshake_timeout)
            self.host, socks = mesh.host, mesh.connect_all()
        crowded = self.crowded = oversubscribed(list(socks.values()))
        self.shm = ShmTuning.from_env()
        self._arena: ShmArena | None = None
        self._arena_tried = False
        self._teams: tuple[Team, Team] | None = None
        self._topology: Topology | None = None
        self._topology_known = False
        self._mailbox: Mailbox | None = None
        self._mailbox_tried = False
        self._mailbox_ops = 0
        self._token = np.zeros(1, np.uint8)
        spin = self.tuning.spin_us * 1e-6 if self.tuning.spin_us >= 0 else (0.0 if crowded else AUTO_SPIN_SECONDS)
        if self.tuning.inline_bytes < 0:
            self.tuning = dataclasses.replace(self.tuning, inline_bytes=AUTO_INLINE_BYTES[crowded])
        self.g = FramedGroup(rank, size, group_name, gid, options.timeout,
                             {p: Peer(s, p, options.timeout, spin, self.tuning.spin_yield, self.tuning.inline_bytes)
                              for p, s in socks.items()})
        self._seq = 0
        self._tx: dict[int, int] = {}
        self._rx: dict[int, int] = {}
        self._tmp = np.empty(0, np.uint8)
        self._views: dict[tuple[int, np.dtype, int], np.ndarray] = {}
        self._bufs: dict[str, np.ndarray] = {}

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        self.g.explain = describe_peer

    def _call(self, op: Op, x: np.ndarray, redop: ReduceOp | None = None, aux: int = 0) -> Call:
        """Start op number `seq` (validated first, so that a rejected call does not advance it)."""
        code = DTYPE_CODE.get(x.dtype) or dtype_code(x.dtype)
        self._seq += 1
        return self.g.call(op, Kind.COLLECTIVE, code, REDUCE_CODES[redop.value] if redop else 0, self._seq, aux, x.size)

    def _sync(self, c: Call) -> None:
        """A step of an op through the arena: one round through the mailbox where it is mapped, without system calls
        (interleaved A/B on 2 cores, 1 MiB ops: 1.1-1.5x at 2 ranks, 1.2-1.5x at 4, which spin yielding the CPU;
        1.1-1.2x at 16 MiB with 4 ranks), else a one-byte exchange over the sockets. Either way the headers are
        compared: a peer in another call raises."""
        box = self._mailbox
        if box is not None:
            self._post(c, box, None)
        else:
            self._recursive_doubling(c, self._token, ReduceOp.MAX)

    def _scratch(self, nbytes: int, dtype: np.dtype, count: int) -> np.ndarray:
        key = (nbytes, dtype, count)
        view = self._views.get(key)
        if view is not None:
            return view
        if self._tmp.nbytes < nbytes:
            self._tmp = np.empty(max(nbytes, 2 * self._tmp.nbytes), np.uint8)
            self._views.clear()
        if len(self._views) >= SCRATCH_VIEWS:
            self._views.clear()
        view = self._views[key] = self._tmp[:nbytes].view(dtype)[:count]
        return view

    def _buffer(self, name: str, nbytes: int, dtype: np.dtype, count: int) -> np.ndarray:
        """A cached scratch buffer other than the receive one (reused across calls: no page faults)."""
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype)[:count]

    def _rolling(self, count: int, dtype: np.dtype) -> np.ndarray:
        return self._buffer("rolling", count * dtype.itemsize, dtype, count)

    def _inplace(self, x: np.ndarray, op_name: str, body: Callable[[np.ndarray], None]) -> None:
        """Run `body` on a contiguous flat view of `x`, copying back if `x` was not contiguous."""
        work = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        self.g.run(op_name, body, work if work.ndim == 1 else work.reshape(-1))
        if work is not x:
            np.copyto(x, work)

    def _node_list(self) -> tuple[tuple[int, ...], ...]:
        assert self._topology is not None  # known once teams exist
        return self._topology.nodes

    def _check_root(self, root: int, what: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}={root!r} is not a rank of group '{self.group_name}' (0..{self.size - 1})")
        return int(root)

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        if type(x) is not np.ndarray:
            x = _numpy(x, "all_reduce input")
        op = check_reduce_op(op, x.dtype)
        if self.size > 1 and low_precision.all_reduce(self, x, op):
            return
        c = self._call(Op.ALL_REDUCE, x, op)
        if self.size == 1:
            return
        box = self._use_mailbox(c, x.nbytes) if 0 < x.nbytes else None
        if box is not None:
            self._inplace(x, "all_reduce", lambda flat: self._mailbox_all_reduce(c, box, flat, op))
            return
        arena = self._use_shm(c, x.nbytes, scale=1 if self.size == 2 else 2)
        if arena is not None:
            self._inplace(x, "all_reduce", lambda flat: self._shm_all_reduce(c, arena, flat, op))
            return
        teams = self._use_hierarchy(c, x.nbytes)
        if teams is not None:
            local, across = teams
            node_arena = local._arena
            assert node_arena is not None
            self._inplace(x, "all_reduce", lambda flat: local._shm_all_reduce(c, node_arena, flat, op, across, self.size))
        elif x.flags.c_contiguous:
            self.g.run("all_reduce", self._all_reduce_flat, c, x if x.ndim == 1 else x.reshape(-1), op)
        else:
            self._inplace(x, "all_reduce", lambda flat: self._all_reduce_flat(c, flat, op))

    def broadcast(self, x: Array, src: int) -> None:
        x = _numpy(x, "broadcast input")
        src = self._check_root(src, "src")
        c = self._call(Op.BROADCAST, x, aux=src)
        if self.size == 1:
            return
        # On a crowded host the socket tree wins: its root need not wait for the others, as a mailbox op must.
        box = self._use_mailbox(c, x.nbytes) if 0 < x.nbytes and not self.crowded else None
        arena = self._use_shm(c, x.nbytes, scale=16 if self.crowded and self._spins() else 2) if box is None else None
        teams = self._use_hierarchy(c, x.nbytes, scale=2) if arena is None and box is None else None
        body: Callable[[Call, np.ndarray, int], None]
        if box is not None:
            body = lambda c, flat, src: self._mailbox_broadcast(c, box, flat, src)  # noqa: E731
        elif arena is not None:
            body = lambda c, flat, src: self._shm_broadcast(c, arena, flat, src)  # noqa: E731
        elif teams is not None:
            body = lambda c, flat, src: two_level.broadcast(c, *teams, self._node_list(), src, flat)  # noqa: E731
        else:
            body = self._broadcast_flat
        if x.flags.c_contiguous or self.rank != src:
            self._inplace(x, "broadcast", lambda flat: body(c, flat, src))
        else:
            self.g.run("broadcast", body, c, np.ascontiguousarray(x).reshape(-1), src)

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        x = _numpy(x, "reduce input")
        op = check_reduce_op(op, x.dtype)
        dst = self._check_root(dst, "dst")
        if low_precision.reduce(self, x, dst, op):
            return
        c = self._call(Op.REDUCE, x, op, aux=dst)
        if self.size == 1:
            return
        self._inplace(x, "reduce", lambda flat: self._tree_reduce(c, flat, dst, op))

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        """As `Backend.all_gather`; `out` (C-contiguous, shape (size, *x.shape)) avoids a fresh allocation.

        Algorithm by output size, see `_all_gather_algorithm`.
        """
        x = _numpy(x, "all_gather input")
        c = self._call(Op.ALL_GATHER, x)
        out = self._out(out, (self.size, *x.shape), x.dtype, "all_gather")
        out[self.rank] = x
        if self.size == 1:
            return out
        box = self._use_mailbox(c, x.nbytes) if 0 < x.nbytes else None
        arena = self._use_shm(c, out.nbytes) if box is None else None
        teams = self._use_hierarchy(c, out.nbytes, scale=1) if arena is None and box is None else None
        if box is not None:
            self.g.run("all_gather", self._mailbox_all_gather, c, box, out)
        elif arena is not None:
            self.g.run("all_gather", self._shm_all_gather, c, arena, out)
        elif teams is not None:
            self.g.run("all_gather", two_level.all_gather, c, *teams, self._node_list(), out, self._buffer)
        else:
            self.g.run("all_gather", self._all_gather_flat, c, out)
        return out

    def _out(self, out: Array | None, shape: tuple[int, ...], dtype: np.dtype, op: str) -> np.ndarray:
        return output_array(out, shape, dtype, op, "tcp")

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        """As `Backend.reduce_scatter`; `out` (C-contiguous, the block's shape) avoids a fresh allocation."""
        x = _numpy(x, "reduce_scatter input")
        op = check_reduce_op(op, x.dtype)
        rows = scatter_rows(x, self.size, "reduce_scatter")
        out = self._out(out, (rows, *x.shape[1:]), x.dtype, "reduce_scatter")
        if self.size > 1 and low_precision.reduce_scatter(self, x, op, out):
            return out
        c = self._call(Op.REDUCE_SCATTER, x, op)
        if self.size == 1:
            np.copyto(out, x)
            if op is ReduceOp.AVG:
                finish_average(out, 1)
            return out
        src = np.ascontiguousarray(x).reshape(-1)
        box = self._use_mailbox(c, src.nbytes) if 0 < src.nbytes else None
        arena = self._use_shm(c, src.nbytes) if box is None else None
        teams = self._use_hierarchy(c, src.nbytes, scale=1) if arena is None and box is None else None
        if box is not None:
            self.g.run("reduce_scatter", self._mailbox_reduce_scatter, c, box, src, out.reshape(-1), op)
        elif arena is not None:
            self.g.run("reduce_scatter", self._shm_reduce_scatter, c, arena, src, out.reshape(-1), op)
        elif teams is not None:
            self.g.run("reduce_scatter", two_level.reduce_scatter, c, *teams, self._node_list(), src, out.reshape(-1),
                       op, self.size, self._buffer)
        else:
            self.g.run("reduce_scatter", self._reduce_scatter_flat, c, src, out.reshape(-1), op)
        return out

    def gather(self, x: Array, dst: int) -> Array | None:
        x = _numpy(x, "gather input")
        dst = self._check_root(dst, "dst")
        c = self._call(Op.GATHER, x, aux=dst)
        if self.rank != dst:
            xb = byte_view(np.ascontiguousarray(x))
            self.g.run("gather", lambda: self.g.wait_sent(c, dst, self.g.send(c, dst, xb)))
            return None
        out = np.empty((self.size, *x.shape), x.dtype)
        out[dst] = x

        def body() -> None:
            for p in range(self.size):
                if p != dst:
                    self.g.recv(c, p, byte_view(out[p : p + 1]))
        self.g.run("gather", body)
        return out

    def scatter(self, x: Array | None, src: int) -> Array:
        src = self._check_root(src, "src")
        if self.rank == src:
            x = _numpy(x, "scatter input on the source rank")
            if x.ndim == 0 or x.shape[0] != self.size or x.ndim > META - 2:
                raise ValueError(f"scatter needs an array of shape ({self.size}, ...) on the source rank, got {x.shape}")
            x = np.ascontiguousarray(x)
            c = self._call(Op.SCATTER, x[0], aux=src)
            meta = np.array([dtype_code(x.dtype), x.ndim - 1, *x.shape[1:]], np.int64)
            mc = self.g.call(Op.SCATTER, Kind.COLLECTIVE, 0, 0, c.seq, src, 0)

            def send_all() -> None:
                for p in range(self.size):
                    if p != src:
                        self.g.send(mc, p, byte_view(meta))
                        self.g.send(c, p, byte_view(x[p : p + 1]))
                self.g.flush(c)
            self.g.run("scatter", send_all)
            return x[src].copy()
        self._seq += 1
        mc = self.g.call(Op.SCATTER, Kind.COLLECTIVE, 0, 0, self._seq, src, 0)
        meta = np.zeros(META, np.int64)

        def receive() -> np.ndarray:
            nbytes = self.g.expect(mc, src, None)
            if nbytes > meta.nbytes or nbytes < 16:
                raise self.g.error(mc, src, f"peer rank {src} sent {nbytes} bytes of scatter metadata")
            self.g.peers[src].recv_into(byte_view(meta)[:nbytes], mc.deadline)
            out = np.empty(tuple(int(d) for d in meta[2 : 2 + meta[1]]), DTYPES[int(meta[0]) - 1])
            c = self.g.call(Op.SCATTER, Kind.COLLECTIVE, int(meta[0]), 0, self._seq, src, out.size)
            self.g.recv(c, src, byte_view(out))
            return out
        return self.g.run("scatter", receive)

    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        """As `Backend.all_to_all`. With split sizes, each block's frame carries its element count and the count
        going the other way, so both ranks of a pair whose split sizes disagree raise, naming the entries."""
        x = _numpy(x, "all_to_all input")
        if input_split_sizes is None and output_split_sizes is None:
            if x.ndim == 0 or x.shape[0] % self.size:
                raise ValueError(f"all_to_all needs x.shape[0] divisible by the group size {self.size}; got {x.shape} "
                                 "(or pass input_split_sizes)")
            ins = outs = [x.shape[0] // self.size] * self.size
            c = self._call(Op.ALL_TO_ALL, x)
        else:
            ins, given = check_splits(x.shape, self.size, self.rank, input_split_sizes, output_split_sizes)
            outs = given if given is not None else [int(v) for v in self.all_to_all(np.array(ins, np.int64))]
            c = self._call(Op.ALL_TO_ALL, x, aux=UNEVEN_ALL_TO_ALL)
        x = np.ascontiguousarray(x)
        out = np.empty((sum(outs), *x.shape[1:]), x.dtype)
        src_at, dst_at = offsets(ins), offsets(outs)
        r, n, g = self.rank, self.size, self.g
        out[dst_at[r] : dst_at[r + 1]] = x[src_at[r] : src_at[r + 1]]
        row = math.prod(x.shape[1:])

        def frame(count: int, back: int) -> Call:
            """The call of one frame: uneven, it carries its block's rows and those going the other way."""
            return g.resized(c, count * row, uneven_aux(back * row)) if c.aux == UNEVEN_ALL_TO_ALL else c

        def body() -> None:
            for k in range(1, n):
                d = (r + k) % n
                g.send(frame(ins[d], outs[d]), d, byte_view(x[src_at[d] : src_at[d + 1]]))
            for k in range(1, n):
                src = (r - k) % n
                g.recv(frame(outs[src], ins[src]), src, byte_view(out[dst_at[src] : dst_at[src + 1]]))
            g.flush(c)
        if n > 1:
            g.run("all_to_all", body)
        return out

    def _p2p(self, x: np.ndarray, peer: int, tag: int, counters: dict[int, int]) -> Call:
        code = dtype_code(x.dtype)
        counters[peer] = counters.get(peer, 0) + 1
        return self.g.call(Op.SEND, Kind.P2P, code, 0, counters[peer], int(tag), x.size)

    def send(self, x: Array, dst: int, tag: int) -> None:
        x = _numpy(x, "send input")
        dst = self._check_root(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        c = self._p2p(x, dst, tag, self._tx)
        xb = byte_view(np.ascontiguousarray(x))
        self.g.run("send", lambda: self.g.wait_sent(c, dst, self.g.send(c, dst, xb)))

    def post_send(self, x: Array, dst: int, tag: int) -> PendingSend:
        """Start a send without waiting for it to leave (isend); the handle waits for it."""
        x = _numpy(x, "isend input")
        dst = self._check_root(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        c = self._p2p(x, dst, tag, self._tx)
        xb = byte_view(np.ascontiguousarray(x))
        ticket = self.g.run("isend", self.g.send, c, dst, xb)
        peer = self.g.peers[dst]

        def wait(timeout: float, strict: bool) -> bool:
            try:
                peer.wait_sent(ticket, time.monotonic() + timeout)
            except PeerTimeout:
                if not strict:
                    return False
                self.g.run("isend", peer.wait_sent, ticket, time.monotonic())
            except PeerError:
                self.g.run("isend", peer.wait_sent, ticket, time.monotonic())
            return True
        return PendingSend(lambda: peer.sent_through(ticket), wait)

    def recv(self, x: Array, src: int, tag: int) -> None:
        x = _numpy(x, "recv buffer")
        src = self._check_root(src, "src")
        if src == self.rank:
            raise ValueError(f"rank {self.rank} cannot receive from itself")
        c = self._p2p(x, src, tag, self._rx)
        self._inplace(x, "recv", lambda flat: self.g.recv(c, src, byte_view(flat)))

    def barrier(self) -> None:
        token = np.zeros(1, np.uint8)
        self._seq += 1
        c = self.g.call(Op.BARRIER, Kind.COLLECTIVE, dtype_code(token.dtype), 0, self._seq, 0, 1)
        box = self._use_mailbox(c, 0)
        if box is not None:
            self.g.run("barrier", self._mailbox_barrier, c, box)
        elif self.size > 1:
            self.g.run("barrier", self._recursive_doubling, c, token, ReduceOp.MAX)

    def close(self) -> None:
        self.g.close_peers()
        if self._arena is not None:
            self._arena.close()
        for team in self._teams or ():
            team.close()
        if self._mailbox is not None:
            self._mailbox.close()
        self._arena, self._teams, self._mailbox, self._arena_tried, self._mailbox_tried = None, None, None, True, True

    def abort(self, reason: str) -> None:
        """Send every peer an abort frame carrying `reason` (each raises `DistributedError` quoting it) and
        shut down writing; the sockets stay open until `close` so that the frames are not lost to a reset."""
        self.g.abort(reason)

    def abort_failed(self, reason: str) -> None:
        """`abort` with `reason` marked as the root cause: peers raise `DistributedError` saying just that."""
        self.g.abort(reason, failed=True)


BACKEND = TcpBackend
