"""The tcp backend: checks, op numbering and one template that runs each op along the route `policy` picks.

A group is a full mesh of authenticated sockets (`transport`). Each op checks its arguments, numbers its call
(the frame header every message carries, so a peer in another op raises), asks `Placement.choose` for its path
(the shared mailbox, single-copy path or arena of ranks on one host, two levels for ranks spread over hosts, or
the sockets) and runs that path's schedule (`shm`, `hierarchy`, `schedules`) inside `FramedGroup.run`, which turns
any transport
failure into a `DistributedError` on every rank. Data moves straight from and into the arrays' buffers;
reductions run in place with NumPy ufuncs, in rank order.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.numerics import low_precision
from axond.distributed.backends.base import Array, Backend, BackendOptions, signature
from axond.distributed.backends.host_arrays import numpy_array, output_array, scatter_rows
from axond.distributed.backends.tcp import policy, prepared
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.placement import Placement
from axond.distributed.backends.tcp.paths.base import own_row
from axond.distributed.backends.tcp.policy import Route
from axond.distributed.backends.tcp.schedules import direct, trees
from axond.distributed.backends.tcp.schedules.group_view import GroupView, Scratch
from axond.distributed.backends.tcp.transport.framing import Call, FramedGroup, byte_view
from axond.distributed.backends.addresses import advertised_host
from axond.distributed.backends.tcp.transport.mesh import Mesh
from axond.distributed.backends.tcp.transport.peer import Peer, PeerError, PeerTimeout
from axond.distributed.backends.tcp.transport.sockets import buffer_limit, host_cores, host_ranks
from axond.distributed.backends.tcp.transport.wire import DTYPE_CODE, REDUCE_CODES, Kind, Op, dtype_code, group_id
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import check_reduce_op, finish_average
from axond.distributed.backends.splits import check_splits
from axond.distributed.work import PendingSend
from axond.store import Store


BARRIER_TOKEN = np.dtype(np.uint8)
"""The dtype a barrier's call names (one element)."""


def _numpy(x: Any, what: str) -> np.ndarray:
    return numpy_array(x, what, "tcp")


class TcpBackend(Backend):
    """Collectives over TCP sockets (and shared memory between the ranks of one host) between the ranks of a group."""

    name = "tcp"
    options_class = TcpOptions

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        super().__init__(store, rank, size, group_name, options)
        tcp: TcpOptions = self.own_options()
        gid = group_id(group_name)
        where = f"group '{group_name}' (rank {rank} of {size})"
        socks, host = {}, ""
        if size > 1:
            me = advertised_host(options.host, options.runtime_env())
            mesh = Mesh(store, rank, size, gid, options.job_secret, me, tcp.port, options.timeout, where,
                        tcp.handshake_timeout)
            host, socks = mesh.host, mesh.connect_all()
        self.host_ranks, self.host_cores = host_ranks(list(socks.values()), tcp.local_ranks), host_cores()
        """Ranks of the group on this host (or the job's, `local_ranks`, if more) and the cores this rank may use."""
        crowded = tcp.oversubscribed if tcp.oversubscribed is not None else self.host_ranks > self.host_cores
        spin, inline = policy.spin_seconds(tcp, crowded), policy.inline_bytes(tcp, crowded)
        buffers = policy.socket_buffer_bytes(tcp, buffer_limit())
        self.g = FramedGroup(rank, size, group_name, gid, options.timeout,
                             {p: Peer(s, p, options.timeout, spin, tcp.spin_yield, inline, buffers, tcp.rto_max_ms,
                                                  tcp.congestion)
                              for p, s in socks.items()})
        self.comm = GroupView(self.g, rank, size, tcp, crowded, Scratch())
        self.placement = Placement(self.comm, host)
        self.numbering = prepared.Numbering()
        self.fresh = prepared.Fresh(self.g, size, self.numbering, self.placement)
        """The prepared form of the op run last, until the group's fast path takes it (`prepared`)."""
        self._tx: dict[tuple[int, int], int] = {}
        self._rx: dict[tuple[int, int], int] = {}
        """Point-to-point frames sent to / received from each (peer, tag): sends and receives match per tag."""

    @property
    def tcp_options(self) -> TcpOptions:
        return self.comm.options

    def route(self, op: Op, nbytes: int) -> Route:
        """The route op `op` on `nbytes` per rank takes in this group as far as it knows its hosts (see `policy`)."""
        return policy.route(op, nbytes, self.placement.shape, self.comm.options)

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        self.g.explain = describe_peer

    def _call(self, op: Op, x: np.ndarray, redop: ReduceOp | None = None, aux: int = 0) -> Call:
        """Start op number `seq` (validated first, so that a rejected call does not advance it)."""
        code = DTYPE_CODE.get(x.dtype) or dtype_code(x.dtype)
        return self.g.call(op, Kind.COLLECTIVE, code, REDUCE_CODES[redop.value] if redop else 0, self._next_seq(), aux,
                           x.size)

    def _next_seq(self) -> int:
        self.numbering.seq += 1
        return self.numbering.seq

    def _inplace(self, x: np.ndarray, op_name: str, body: Callable[[np.ndarray], None]) -> None:
        """Run `body` on a contiguous flat view of `x`, copying back if `x` was not contiguous."""
        work = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        self.g.run(op_name, body, work if work.ndim == 1 else work.reshape(-1))
        if work is not x:
            np.copyto(x, work)  # x is not contiguous: NumPy's strided loop

    def _in_place(self, x: np.ndarray, op_name: str, body: Callable[..., None], c: Call, *rest: Any) -> None:
        """`_inplace` for a path method: `body(c, flat, *rest)`."""
        work = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        self.g.run(op_name, body, c, work if work.ndim == 1 else work.reshape(-1), *rest)
        if work is not x:
            np.copyto(x, work)  # x is not contiguous: NumPy's strided loop

    def _check_root(self, root: int, what: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}={root!r} is not a rank of group '{self.group_name}' (0..{self.size - 1})")
        return int(root)

    def _peer(self, peer: int, what: str, verb: str) -> int:
        peer = self._check_root(peer, what)
        if peer == self.rank:
            raise ValueError(f"rank {self.rank} cannot {verb} itself")
        return peer

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        if type(x) is not np.ndarray:
            x = _numpy(x, "all_reduce input")
        op = check_reduce_op(op, x.dtype)
        if self.size > 1 and low_precision.all_reduce(self, x, op):
            return
        c = self._call(Op.ALL_REDUCE, x, op)
        if self.size == 1:
            return
        path = self.placement.choose(c, Op.ALL_REDUCE, x.nbytes)
        self._in_place(x, "all_reduce", path.all_reduce, c, op)
        if x.flags.c_contiguous:
            self.fresh.keep(signature("all_reduce", x, op), path, c,
                            lambda make_call: path.prepare_all_reduce(c, x, op, make_call),
                            lambda fresh, small: prepared.flat(fresh, small, "all_reduce"))

    def prepared(self, signature: tuple[Any, ...]) -> prepared.Runner | None:
        """The runner of the small op of `signature` just run through the mailbox (see `tcp.prepared`), or None."""
        return self.fresh.take(signature)

    def broadcast(self, x: Array, src: int) -> None:
        x = _numpy(x, "broadcast input")
        src = self._check_root(src, "src")
        c = self._call(Op.BROADCAST, x, aux=src)
        if self.size == 1:
            return
        path = self.placement.choose(c, Op.BROADCAST, x.nbytes)
        if x.flags.c_contiguous or self.rank != src:
            self._in_place(x, "broadcast", path.broadcast, c, src)
        else:
            self.g.run("broadcast", path.broadcast, c, np.ascontiguousarray(x).reshape(-1), src)
        if x.flags.c_contiguous:
            self.fresh.keep(signature("broadcast", x, src), path, c,
                            lambda make_call: path.prepare_broadcast(c, x, src, make_call),
                            lambda fresh, small: prepared.flat(fresh, small, "broadcast"))

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        x = _numpy(x, "reduce input")
        op = check_reduce_op(op, x.dtype)
        dst = self._check_root(dst, "dst")
        if low_precision.reduce(self, x, dst, op):
            return
        c = self._call(Op.REDUCE, x, op, aux=dst)
        if self.size > 1:
            self._in_place(x, "reduce", self._tree_reduce, c, dst, op)

    def _tree_reduce(self, c: Call, x: np.ndarray, dst: int, op: ReduceOp) -> None:
        trees.tree_reduce(self.comm, c, x, dst, op)

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        """As `Backend.all_gather`; `out` (C-contiguous, shape (size, *x.shape)) avoids a fresh allocation."""
        x = _numpy(x, "all_gather input")
        c = self._call(Op.ALL_GATHER, x)
        out = output_array(out, (self.size, *x.shape), x.dtype, "all_gather", "tcp")
        if self.size == 1:
            own_row(out, x, 0)
            return out
        path = self.placement.choose(c, Op.ALL_GATHER, x.nbytes)
        self.g.run("all_gather", path.all_gather, c, out, x)
        self.fresh.keep(signature("all_gather", x, None), path, c,
                        lambda make_call: path.prepare_all_gather(c, x, make_call), prepared.all_gather)
        return out

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        """As `Backend.reduce_scatter`; `out` (C-contiguous, the block's shape) avoids a fresh allocation."""
        x = _numpy(x, "reduce_scatter input")
        op = check_reduce_op(op, x.dtype)
        rows = scatter_rows(x, self.size, "reduce_scatter")
        out = output_array(out, (rows, *x.shape[1:]), x.dtype, "reduce_scatter", "tcp")
        if self.size > 1 and low_precision.reduce_scatter(self, x, op, out):
            return out
        c = self._call(Op.REDUCE_SCATTER, x, op)
        if self.size == 1:
            np.copyto(out, x)
            if op is ReduceOp.AVG:
                finish_average(out, 1)
            return out
        src, dst = np.ascontiguousarray(x).reshape(-1), out.reshape(-1)
        path = self.placement.choose(c, Op.REDUCE_SCATTER, src.nbytes)
        self.g.run("reduce_scatter", path.reduce_scatter, c, src, dst, op)
        if x.flags.c_contiguous:
            self.fresh.keep(signature("reduce_scatter", x, op), path, c,
                            lambda make_call: path.prepare_reduce_scatter(c, src, dst.size, op, make_call),
                            prepared.reduce_scatter)
        return out

    def gather(self, x: Array, dst: int) -> Array | None:
        x = _numpy(x, "gather input")
        dst = self._check_root(dst, "dst")
        c = self._call(Op.GATHER, x, aux=dst)
        out = np.empty((self.size, *x.shape), x.dtype) if self.rank == dst else None
        self.g.run("gather", direct.gather, self.comm, c, x, out, dst)
        return out

    def scatter(self, x: Array | None, src: int) -> Array:
        src = self._check_root(src, "src")
        if self.rank != src:
            return self.g.run("scatter", direct.receive_scattered, self.comm, self._next_seq(), src)
        x = _numpy(x, "scatter input on the source rank")
        if x.ndim == 0 or x.shape[0] != self.size or x.ndim > direct.META - 2:
            raise ValueError(f"scatter needs an array of shape ({self.size}, ...) on the source rank, got {x.shape}")
        x = np.ascontiguousarray(x)
        c = self._call(Op.SCATTER, x[0], aux=src)
        self.g.run("scatter", direct.send_scattered, self.comm, c, x, src)
        return x[src].copy()

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
            c = self._call(Op.ALL_TO_ALL, x, aux=direct.UNEVEN)
        x = np.ascontiguousarray(x)
        out = np.empty((sum(outs), *x.shape[1:]), x.dtype)
        self.g.run("all_to_all", direct.all_to_all, self.comm, c, x, out, ins, outs)
        return out

    def posts_from_any_thread(self) -> bool:
        """Yes: `Peer.send` serializes its posters, beside the op running on the communication thread."""
        return True

    def _p2p(self, x: np.ndarray, peer: int, tag: int, counters: dict[tuple[int, int], int],
             posted: bool = False) -> Call:
        code = dtype_code(x.dtype)
        key = (peer, int(tag))
        counters[key] = counters.get(key, 0) + 1
        make = self.g.posted_call if posted else self.g.call
        return make(Op.SEND, Kind.P2P, code, 0, counters[key], int(tag), x.size)

    def send(self, x: Array, dst: int, tag: int) -> None:
        x = _numpy(x, "send input")
        dst = self._peer(dst, "dst", "send to")
        c = self._p2p(x, dst, tag, self._tx)
        xb = byte_view(np.ascontiguousarray(x))
        self.g.run("send", lambda: self.g.wait_sent(c, dst, self.g.send(c, dst, xb)))

    def post_send(self, x: Array, dst: int, tag: int) -> PendingSend:
        """Start a send without waiting for it to leave (isend); the handle waits for it."""
        x = _numpy(x, "isend input")
        dst = self._peer(dst, "dst", "send to")
        c = self._p2p(x, dst, tag, self._tx, posted=True)
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
        src = self._peer(src, "src", "receive from")
        c = self._p2p(x, src, tag, self._rx)
        self._inplace(x, "recv", lambda flat: self.g.recv_p2p(c, src, byte_view(flat)))

    def recv_any(self, x: Array, tag: int) -> int:
        """Receive into `x` the first point-to-point frame of `tag` from any peer; returns the sender's group rank.
        Waits on every peer's socket at once (bounded by the group timeout). A peer already in a later collective
        is passed over (it sends nothing to this rank before this rank joins it), unless every peer is."""
        x = _numpy(x, "recv buffer")
        peers = [r for r in self.g.peers if r != self.rank]
        ahead: list[int] = []
        deadline = time.monotonic() + self.options.timeout
        while True:
            for r in list(peers):
                ready = self.g.run("recv", self.g.p2p_waiting, r, int(tag))
                if ready is None and self.g.ahead_in_collective(r):
                    peers.remove(r)
                    ahead.append(r)
                    continue
                if ready or ready is None:  # None: an abort or a closed link; receiving reports it
                    self.recv(x, r, tag)
                    return r
            if not peers:  # every peer waits in a collective for this rank: receiving reports the mismatch
                self.recv(x, ahead[0], tag)
                return ahead[0]
            left = deadline - time.monotonic()
            if left <= 0:
                self.g.failed("recv", PeerTimeout(f"no send of tag {tag} from any peer", peers[0]))
            select.select([self.g.peers[r].fileno() for r in peers], [], [], min(left, 1.0))

    def barrier(self) -> None:
        c = self.g.call(Op.BARRIER, Kind.COLLECTIVE, dtype_code(BARRIER_TOKEN), 0, self._next_seq(), 0, 1)
        if self.size == 1:
            return
        path = self.placement.choose(c, Op.BARRIER, 0)
        self.g.run("barrier", path.barrier, c)
        self.fresh.keep(signature("barrier", None, None), path, c, lambda make_call: path.prepare_barrier(c, make_call),
                        prepared.barrier)

    def close(self) -> None:
        self.g.close_peers()
        self.placement.close()

    def abort(self, reason: str) -> None:
        """Send every peer an abort frame carrying `reason` (each raises `DistributedError` quoting it) and
        shut down writing; the sockets stay open until `close` so that the frames are not lost to a reset."""
        self.g.abort(reason)

    def abort_failed(self, reason: str) -> None:
        """`abort` with `reason` marked as the root cause: peers raise `DistributedError` saying just that."""
        self.g.abort(reason, failed=True)

    def interrupt(self, reason: str) -> None:
        """`abort`, then shut this rank's side of every link down: its blocked receives and sends end at once."""
        self.g.interrupt(reason)


BACKEND = TcpBackend
