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
from axond.distributed.backends.base import Array, Backend, BackendOptions, PreparedOps
from axond.distributed.backends.host_arrays import numpy_array, output_array, scatter_rows
from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.placement import Placement
from axond.distributed.backends.tcp.paths.base import DataPath, own_row
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
from axond.errors import DistributedError
from axond.store import Store


BARRIER_TOKEN = np.dtype(np.uint8)
"""The dtype a barrier's call names (one element)."""
SMALL_PLANS = 64
"""Prepared small mailbox ops kept per group (op, dtype, size and op or root combinations); all dropped when full."""


def _numpy(x: Any, what: str) -> np.ndarray:
    return numpy_array(x, what, "tcp")


class TcpBackend(Backend, PreparedOps):
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
                             {p: Peer(s, p, options.timeout, spin, tcp.spin_yield, inline, buffers)
                              for p, s in socks.items()})
        self.comm = GroupView(self.g, rank, size, tcp, crowded, Scratch())
        self.placement = Placement(self.comm, host)
        self._seq = 0
        self._small: dict[tuple[Any, ...], Any] = {}
        """Prepared small mailbox ops by op name, dtype, size and op or root (`_prepare`)."""
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
        self._seq += 1
        return self.g.call(op, Kind.COLLECTIVE, code, REDUCE_CODES[redop.value] if redop else 0, self._seq, aux, x.size)

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

    def quick_all_reduce(self, x: Array, op: ReduceOp) -> bool:
        """A small all_reduce of a dtype, size and op that went through the mailbox before (every check passed
        then): straight to its prepared form (`mailbox_ops.SmallAllReduce`)."""
        if type(x) is not np.ndarray or type(op) is not ReduceOp:
            return False
        return self._run_prepared("all_reduce", self._small.get(("all_reduce", x.dtype, x.size, id(op))), x)

    def quick_broadcast(self, x: Array, src: int) -> bool:
        """As `quick_all_reduce`, for a small broadcast from group rank `src` (`mailbox_ops.SmallBroadcast`)."""
        if type(x) is not np.ndarray or type(src) is not int:
            return False
        return self._run_prepared("broadcast", self._small.get(("broadcast", x.dtype, x.size, src)), x)

    def quick_all_gather(self, x: Array, out: Array | None) -> Array | None:
        """As `quick_all_reduce`, for a small all_gather into `out` (checked here) or a fresh array
        (`mailbox_ops.SmallAllGather`); None having done nothing."""
        if type(x) is not np.ndarray:
            return None
        small = self._small.get(("all_gather", x.dtype, x.size))
        if small is None or small.box is not self.placement.mailbox or self.g.aborted:
            return None
        shape = (self.size, *x.shape)
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            return None  # the full way says what is wrong with it
        self._seq += 1
        try:
            small.run(out, self._seq, x)  # x into row `rank` too
        except (DistributedError, PeerError) as e:
            self.g.failed("all_gather", e)
        return out

    def quick_reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None) -> Array | None:
        """As `quick_all_gather`, for a small reduce_scatter (`mailbox_ops.SmallReduceScatter`)."""
        if type(x) is not np.ndarray or type(op) is not ReduceOp:
            return None
        small = self._small.get(("reduce_scatter", x.dtype, x.shape, id(op)))
        if small is None or small.box is not self.placement.mailbox or not x.flags.c_contiguous or self.g.aborted:
            return None
        shape = (x.shape[0] // self.size, *x.shape[1:])
        if out is None:
            out = np.empty(shape, x.dtype)
        elif not (type(out) is np.ndarray and out.shape == shape and out.dtype == x.dtype and out.flags.c_contiguous):
            return None  # the full way says what is wrong with it
        self._seq += 1
        try:
            small.run(x.reshape(-1), out.reshape(-1), self._seq)
        except (DistributedError, PeerError) as e:
            self.g.failed("reduce_scatter", e)
        return out

    def quick_barrier(self) -> bool:
        """As `quick_all_reduce`, for a barrier (`mailbox_ops.SmallBarrier`)."""
        small = self._small.get(("barrier",))
        if small is None or small.box is not self.placement.mailbox or self.g.aborted:
            return False
        self._seq += 1
        try:
            small.run(self._seq)
        except (DistributedError, PeerError) as e:
            self.g.failed("barrier", e)
        return True

    def _run_prepared(self, name: str, small: Any, x: np.ndarray) -> bool:
        """Run `small` on `x` as the group's next op (True), or nothing (False: not prepared, not contiguous, the
        mailbox changed or the group was aborted; the full way then checks and raises as it should)."""
        if small is None or small.box is not self.placement.mailbox or not x.flags.c_contiguous or self.g.aborted:
            return False
        self._seq += 1
        try:
            small.run(x if x.ndim == 1 else x.reshape(-1), self._seq)
        except (DistributedError, PeerError) as e:
            self.g.failed(name, e)
        return True

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        if self.quick_all_reduce(x, op):
            return
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
        self._prepare(("all_reduce", x.dtype, x.size, id(op)), path, c,
                      lambda make_call: path.prepare_all_reduce(c, x, op, make_call))

    def _prepare(self, key: tuple[Any, ...], path: DataPath, c: Call,
                 build: Callable[[Callable[[int], Call]], Any]) -> None:
        """Keep the prepared form of an op that `path` keeps (`mailbox_ops.Prepared`) under `key`: the next call of
        that shape skips the checks, the route and the `Call` (made only if it waits long or fails, by `make_call`)."""
        box = path.prepares_through
        if box is None:
            return
        known = self._small.get(key)
        if known is not None and known.box is box:
            return  # a caller whose array is not contiguous: prepared already, for the contiguous ones
        if len(self._small) >= SMALL_PLANS:
            self._small.clear()

        def make_call(seq: int) -> Call:
            return self.g.call(c.op, c.kind, c.dtype, c.redop, seq, c.aux, c.count)

        prepared = build(make_call)
        if prepared is not None:
            self._small[key] = prepared

    def broadcast(self, x: Array, src: int) -> None:
        if self.quick_broadcast(x, src):
            return
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
        self._prepare(("broadcast", x.dtype, x.size, src), path, c,
                      lambda make_call: path.prepare_broadcast(c, x, src, make_call))

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
        gathered = self.quick_all_gather(x, out)
        if gathered is not None:
            return gathered
        x = _numpy(x, "all_gather input")
        c = self._call(Op.ALL_GATHER, x)
        out = output_array(out, (self.size, *x.shape), x.dtype, "all_gather", "tcp")
        if self.size == 1:
            own_row(out, x, 0)
            return out
        path = self.placement.choose(c, Op.ALL_GATHER, x.nbytes)
        self.g.run("all_gather", path.all_gather, c, out, x)
        self._prepare(("all_gather", x.dtype, x.size), path, c,
                      lambda make_call: path.prepare_all_gather(c, x, make_call))
        return out

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        """As `Backend.reduce_scatter`; `out` (C-contiguous, the block's shape) avoids a fresh allocation."""
        scattered = self.quick_reduce_scatter(x, op, out)
        if scattered is not None:
            return scattered
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
        self._prepare(("reduce_scatter", x.dtype, x.shape, id(op)), path, c,
                      lambda make_call: path.prepare_reduce_scatter(c, src, dst.size, op, make_call))
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
            self._seq += 1
            return self.g.run("scatter", direct.receive_scattered, self.comm, self._seq, src)
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
        if self.quick_barrier():
            return
        self._seq += 1
        c = self.g.call(Op.BARRIER, Kind.COLLECTIVE, dtype_code(BARRIER_TOKEN), 0, self._seq, 0, 1)
        if self.size == 1:
            return
        path = self.placement.choose(c, Op.BARRIER, 0)
        self.g.run("barrier", path.barrier, c)
        self._prepare(("barrier",), path, c, lambda make_call: path.prepare_barrier(c, make_call))

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


BACKEND = TcpBackend
