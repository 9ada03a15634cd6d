"""The mock backend: the members of a group are threads of one process meeting in a shared hub; no socket.

For unit tests of code that uses collectives (`axond.testing.run_threads(fn, n, backend="mock")`,
`ProcessGroup.mock()`). Each collective meets at a slot of the group's `hub.Hub`: every member posts a
copy of its input and what it called (checked as tcp checks frame headers, so a mismatch raises on every
member, naming the peer), then computes its result from the copies. Reductions run in rank order, as tcp's
shared-memory paths (its mailbox and arena on one host) do, and `reduce` in tcp's binomial-tree order, so float
results match tcp's bit for bit there. Sends are buffered per pair and received in order, checked against the receive.
Every wait is bounded by the group's timeout; a failure aborts the group for every member, as on tcp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from axond.distributed.backends.base import Array, Backend, BackendOptions
from axond.distributed.backends.host_arrays import numpy_array, output_array, scatter_rows
from axond.distributed.backends.chunking import binomial_children
from axond.distributed.backends.mock.hub import Call, HubError, Post, call_text, join
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.reducers import UFUNCS, accumulator, check_reduce_op, finish_average, narrow_into
from axond.distributed.backends.splits import announcement, check_splits, offsets, settle
from axond.distributed.ops import OP_NAMES, REDUCE_CODES, UNEVEN_ALL_TO_ALL, Op, dtype_code
from axond.errors import DistributedError
from axond.store import Store


def _numpy(x: Any, what: str) -> np.ndarray:
    return numpy_array(x, what, "mock")


def _flat_copy(x: np.ndarray) -> np.ndarray:
    """A private C-ordered flat copy of `x` (what a member posts: peers read it while the owner moves on)."""
    return np.array(x, order="C").reshape(-1)


def _reduce_rows(rows: Sequence[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """out <- the reduction of `rows` in order (rank order), as tcp's mailbox and shared-memory paths compute it."""
    wide = accumulator(out.dtype, op)
    if wide is not None:
        acc = np.empty(out.shape, wide)
        _reduce_rows([r.astype(wide) for r in rows], acc, op)
        narrow_into(out, acc)
        return
    ufunc = UFUNCS[op]
    if len(rows) == 1:
        np.copyto(out, rows[0])
    else:
        ufunc(rows[0], rows[1], out=out)
        for row in rows[2:]:
            ufunc(out, row, out=out)
    if op is ReduceOp.AVG:
        finish_average(out, len(rows))


class MockBackend(Backend):
    """Collectives between threads of one process through shared memory of the interpreter (tests)."""

    name = "mock"

    def __init__(self, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> None:
        super().__init__(store, rank, size, group_name, options)
        self.hub = join(store, rank, size, group_name, options.timeout)
        self._seq = 0
        self._aborted: str | None = None
        self._explain: Callable[[int], str] | None = None

    def explain_timeouts(self, describe_peer: Callable[[int], str],
                         describe_peers: Callable[[str], str] | None = None) -> None:
        """A peer that times out this rank while in no op of this group is described by `describe_peer` (what it
        published it is blocked in, e.g. an op of another group: a cross-group deadlock)."""
        self._explain = describe_peer

    def _hub_failure(self, op: str, e: HubError) -> DistributedError:
        what = e.what
        if e.idle and e.peer is not None and self._explain is not None:
            what += f"; {self._explain(e.peer)}"
        return self._fail(op, e.peer, what)

    def _where(self, op: str) -> str:
        return f"{op} on group '{self.group_name}' (rank {self.rank} of {self.size})"

    def _enter(self, op: str) -> None:
        if self._aborted is not None:
            raise DistributedError(f"{self._where(op)}: the group was aborted by an earlier failure ({self._aborted}); "
                                   "destroy it and create a new group", op=op, group=self.group_name, rank=self.rank)

    def _fail(self, op: str, peer: int | None, what: str) -> DistributedError:
        """The error of `op` about `peer`; the group is aborted with it, so that every member raises too."""
        error = DistributedError(f"{self._where(op)}: {what}", op=op, group=self.group_name, rank=self.rank, peer=peer)
        self._give_up(str(error))
        return error

    def _give_up(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self.hub.abort(self.rank, reason)

    def _meet(self, op: Op, x: np.ndarray | None, data: Any, redop: ReduceOp | None = None, aux: int = 0,
              count: int | None = None) -> list[Any]:
        """Run collective `op` with every member: post `data`, check the calls agree; every member's data by rank."""
        name = OP_NAMES[op]
        self._enter(name)
        code = dtype_code(x.dtype) if x is not None else 0
        call: Call = (int(op), code, REDUCE_CODES[redop.value] if redop else 0, aux,
                      (x.size if x is not None else 0) if count is None else count)
        self._seq += 1
        try:
            posts = self.hub.meet(self._seq, self.rank, Post(call, data), self.options.timeout, self._where(name))
        except HubError as e:
            raise self._hub_failure(name, e) from None
        for peer, post in enumerate(posts):
            if post.call != call:
                raise self._fail(name, peer, f"peer rank {peer} called {call_text(post.call)} "
                                             f"but this rank called {call_text(call)}")
        return [post.data for post in posts]

    def _check_root(self, root: int, what: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}={root!r} is not a rank of group '{self.group_name}' (0..{self.size - 1})")
        return int(root)

    def _out(self, out: Array | None, shape: tuple[int, ...], dtype: np.dtype, op: str) -> np.ndarray:
        return output_array(out, shape, dtype, op, "mock")

    def all_reduce(self, x: Array, op: ReduceOp) -> None:
        x = _numpy(x, "all_reduce input")
        op = check_reduce_op(op, x.dtype)
        rows = self._meet(Op.ALL_REDUCE, x, _flat_copy(x), op)
        if self.size > 1:
            self._into(x, lambda flat: _reduce_rows(rows, flat, op))

    @staticmethod
    def _into(x: np.ndarray, fill: Callable[[np.ndarray], object]) -> None:
        """Have `fill(flat)` write a flat view of `x` (through a contiguous copy if `x` is not contiguous)."""
        if x.flags.c_contiguous:
            fill(x.reshape(-1))
        else:
            work = np.empty(x.size, x.dtype)
            fill(work)
            np.copyto(x, work.reshape(x.shape))

    def broadcast(self, x: Array, src: int) -> None:
        x = _numpy(x, "broadcast input")
        src = self._check_root(src, "src")
        rows = self._meet(Op.BROADCAST, x, _flat_copy(x) if self.rank == src else None, aux=src)
        if self.rank != src:
            self._into(x, lambda flat: np.copyto(flat, rows[src]))

    def reduce(self, x: Array, dst: int, op: ReduceOp) -> None:
        x = _numpy(x, "reduce input")
        op = check_reduce_op(op, x.dtype)
        dst = self._check_root(dst, "dst")
        rows = self._meet(Op.REDUCE, x, _flat_copy(x), op, aux=dst)
        if self.rank == dst and self.size > 1:
            self._into(x, lambda flat: np.copyto(flat, self._tree(rows, dst, op), casting="unsafe"))

    def _tree(self, rows: list[np.ndarray], dst: int, op: ReduceOp) -> np.ndarray:
        """The reduction in tcp's binomial-tree order: each member adds its children's partial results to its own."""
        ufunc = UFUNCS[op]
        wide = accumulator(rows[0].dtype, op)

        def partial(v: int) -> np.ndarray:
            acc: np.ndarray = rows[(v + dst) % self.size].astype(wide or rows[0].dtype)
            for child in binomial_children(v, self.size):
                ufunc(acc, partial(child), out=acc)
            return acc
        total = partial(0)
        if op is ReduceOp.AVG:
            finish_average(total, self.size)
        return total

    def all_gather(self, x: Array, out: Array | None = None) -> Array:
        x = _numpy(x, "all_gather input")
        out = self._out(out, (self.size, *x.shape), x.dtype, "all_gather")
        rows = self._meet(Op.ALL_GATHER, x, _flat_copy(x))
        flat = out.reshape(self.size, -1)
        for p, row in enumerate(rows):
            flat[p] = row
        return out

    def reduce_scatter(self, x: Array, op: ReduceOp, out: Array | None = None) -> Array:
        x = _numpy(x, "reduce_scatter input")
        op = check_reduce_op(op, x.dtype)
        rows = scatter_rows(x, self.size, "reduce_scatter")
        out = self._out(out, (rows, *x.shape[1:]), x.dtype, "reduce_scatter")
        posted = self._meet(Op.REDUCE_SCATTER, x, _flat_copy(x), op)
        per = out.size
        blocks = [p[self.rank * per : (self.rank + 1) * per] for p in posted]
        _reduce_rows(blocks, out.reshape(-1), op)
        return out

    def gather(self, x: Array, dst: int) -> Array | None:
        x = _numpy(x, "gather input")
        dst = self._check_root(dst, "dst")
        rows = self._meet(Op.GATHER, x, _flat_copy(x) if self.rank != dst else None, aux=dst)
        if self.rank != dst:
            return None
        out = np.empty((self.size, *x.shape), x.dtype)
        flat = out.reshape(self.size, -1)
        for p, row in enumerate(rows):
            flat[p] = row if p != dst else x.reshape(-1)
        return out

    def scatter(self, x: Array | None, src: int) -> Array:
        src = self._check_root(src, "src")
        if self.rank == src:
            x = _numpy(x, "scatter input on the source rank")
            if x.ndim == 0 or x.shape[0] != self.size:
                raise ValueError(f"scatter needs an array of shape ({self.size}, ...) on the source rank, "
                                 f"got {x.shape}")
            dtype_code(x.dtype)  # refuses the dtypes tcp cannot move, as tcp does
        full = np.array(x, order="C") if self.rank == src else None
        rows = self._meet(Op.SCATTER, None, full, aux=src)
        return np.array(rows[src][self.rank])

    def all_to_all(self, x: Array, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Array:
        """As `Backend.all_to_all`; with split sizes, both members of a pair that disagree raise, naming the entries."""
        x = _numpy(x, "all_to_all input")
        uneven = input_split_sizes is not None or output_split_sizes is not None
        if not uneven and (x.ndim == 0 or x.shape[0] % self.size):
            raise ValueError(f"all_to_all needs x.shape[0] divisible by the group size {self.size}; got {x.shape} "
                             "(or pass input_split_sizes)")
        ins, given = check_splits(x.shape, self.size, self.rank, input_split_sizes, output_split_sizes)
        row = int(np.prod(x.shape[1:]))
        said = announcement(ins, given, row) if uneven else None
        mine = (_flat_copy(x), [v * row for v in offsets(ins)], said)
        aux, count = (UNEVEN_ALL_TO_ALL, 0) if uneven else (0, None)
        posted = self._meet(Op.ALL_TO_ALL, x, mine, aux=aux, count=count)
        r, outs = self.rank, ins
        if uneven:
            heard = np.array([announced[r] for _, _, announced in posted], np.int64)
            outs, problems = settle(r, ins, given, row, heard)
            if problems:
                peer, why = problems[0]
                raise self._fail("all_to_all", peer, why)
        out = np.empty((sum(outs), *x.shape[1:]), x.dtype)
        flat, at = out.reshape(-1), offsets([v * row for v in outs])
        for p, (data, starts, _) in enumerate(posted):
            flat[at[p] : at[p + 1]] = data[starts[r] : starts[r + 1]]
        return out

    def send(self, x: Array, dst: int, tag: int) -> None:
        """Queue a copy of `x` for `dst` and return: sends are buffered, so they never wait for the receive."""
        x = _numpy(x, "send input")
        dst = self._check_root(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        post = Post((int(Op.SEND), dtype_code(x.dtype), 0, int(tag), x.size), _flat_copy(x))
        self._enter("send")
        try:
            self.hub.send(self.rank, dst, post)
        except HubError as e:
            raise self._hub_failure("send", e) from None

    def recv(self, x: Array, src: int, tag: int) -> None:
        """Receive the next message from `src` into `x`; its tag, dtype and element count must be the receive's."""
        x = _numpy(x, "recv buffer")
        src = self._check_root(src, "src")
        if src == self.rank:
            raise ValueError(f"rank {self.rank} cannot receive from itself")
        mine: Call = (int(Op.SEND), dtype_code(x.dtype), 0, int(tag), x.size)
        self._enter("recv")
        try:
            post = self.hub.recv(src, self.rank, int(tag), self.options.timeout, self._where("recv"))
        except HubError as e:
            raise self._hub_failure("recv", e) from None
        if post.call != mine:
            raise self._fail("recv", src, f"peer rank {src} called {call_text(post.call)} but this rank called "
                                          f"recv{call_text(mine).removeprefix('send')}")
        self._into(x, lambda flat: np.copyto(flat, post.data))

    def barrier(self) -> None:
        self._meet(Op.BARRIER, np.zeros(1, np.uint8), None)

    def close(self) -> None:
        if self._aborted is None:
            self._aborted = "the group was destroyed"
        self.hub.leave(self.rank)

    def abort(self, reason: str) -> None:
        """Give up: members waiting for this one, or calling an op later, raise `DistributedError` quoting `reason`."""
        self._give_up(reason)


BACKEND = MockBackend
