"""`ProcessGroup`: a backend plus the global ranks it spans, with every collective as a method.

Ranks given to methods (src, dst) are GROUP-LOCAL, like torch's ProcessGroup objects; the
module-level functions in `axond.distributed.api` take global ranks and translate. How each op runs (in issue
order, timed, its failure shortened) and the group's life are `GroupCore`'s (`axond.distributed.group_core`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from axond.distributed.backends.base import P2P, Array, BackendOptions, Completion
from axond.distributed.backends.registry import create_backend, resolve_backend
from axond.distributed.diagnostics.failure import concise, debug
from axond.distributed.diagnostics.monitored_barrier import monitored_barrier
from axond.distributed.forms.scalars import refuse_scalar
from axond.distributed.group_core import ASYNC_MARGIN, GroupCore
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.work import Work
from axond.errors import DistributedError
from axond.store import InMemoryStore, PrefixStore, Store
from axond.store.init_methods import seconds


class ProcessGroup(GroupCore):
    """A communicator over `ranks` (global ranks); `rank`/`size` are this member's place in it."""

    _subgroups = 0
    """Subgroups made from this group so far (their names count them)."""
    _monitored = 0
    """Monitored barriers run on this group so far (each has its own keys in the store)."""

    @classmethod
    def mock(cls, timeout: float = 60.0) -> ProcessGroup:
        """A group of one rank on the in-process "mock" backend (no socket, no store to set up): rank 0 of 1.

        For unit tests of code that takes a group: every collective runs as on one rank. `timeout`
        (seconds) bounds its calls; subgroups (`new_group([0])`) are mock groups too.
        """
        return create_group(InMemoryStore(), 0, 1, "mock", BackendOptions(timeout=timeout))

    def all_reduce(self, x: Array, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce `x` in place over the group."""
        if not async_op and type(x) is np.ndarray:
            return self._fast("all_reduce", x, op, x, op)
        refuse_scalar(x, "all_reduce")
        return self._run("all_reduce", async_op, x, op)

    def broadcast(self, x: Array, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy `x` of group rank `src` into `x` everywhere."""
        if not async_op and type(x) is np.ndarray:
            return self._fast("broadcast", x, src, x, src)
        refuse_scalar(x, "broadcast")
        return self._run("broadcast", async_op, x, src)

    def reduce(self, x: Array, dst: int = 0, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce `x` into `x` on group rank `dst`."""
        refuse_scalar(x, "reduce")
        return self._run("reduce", async_op, x, dst, op)

    def all_gather(self, x: Array, async_op: bool = False, out: Array | None = None) -> Any:
        """Return (size, *x.shape) with every rank's `x` (a Work whose result() is it when async).

        `out=` (shape (size, *x.shape)) is filled and returned instead of a new array: no allocation.
        """
        if not async_op and type(x) is np.ndarray:
            return self._fast("all_gather", x, None, x, out)
        refuse_scalar(x, "all_gather")
        if out is None:
            return self._run("all_gather", async_op, x)
        return self._run("all_gather", async_op, x, out=out)

    def reduce_scatter(self, x: Array, op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
                       out: Array | None = None) -> Any:
        """Reduce `x` and return this rank's block of x.shape[0] // size rows (into `out=` if given)."""
        if not async_op and type(x) is np.ndarray:
            return self._fast("reduce_scatter", x, op, x, op, out)
        refuse_scalar(x, "reduce_scatter")
        if out is None:
            return self._run("reduce_scatter", async_op, x, op)
        return self._run("reduce_scatter", async_op, x, op, out=out)

    def gather(self, x: Array, dst: int = 0, async_op: bool = False) -> Any:
        """Return (size, *x.shape) on group rank `dst`, None elsewhere."""
        refuse_scalar(x, "gather")
        return self._run("gather", async_op, x, dst)

    def scatter(self, x: Array | None, src: int = 0, async_op: bool = False) -> Any:
        """Return this rank's slice of `x` (shape (size, ...)) held by group rank `src`."""
        refuse_scalar(x, "scatter")
        return self._run("scatter", async_op, x, src)

    def all_to_all(self, x: Array, async_op: bool = False, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None) -> Any:
        """Row block i of `x` goes to group rank i; return the received blocks in rank order.

        Blocks split x.shape[0] evenly, or as `input_split_sizes` (rows to each rank); the result has
        sum(output_split_sizes) rows, `output_split_sizes[j]` of them from rank j. Without output sizes,
        the peers are asked (one small extra all_to_all). As torch's `all_to_all_single`.
        """
        refuse_scalar(x, "all_to_all")
        if input_split_sizes is None and output_split_sizes is None:
            return self._run("all_to_all", async_op, x)
        return self._run("all_to_all", async_op, x, input_split_sizes, output_split_sizes)

    def send(self, x: Array, dst: int, tag: int = 0) -> None:
        """Send `x` to group rank `dst`."""
        refuse_scalar(x, "send")
        self._run("send", False, x, dst, tag)

    def recv(self, x: Array, src: int, tag: int = 0) -> int:
        """Receive into `x` from group rank `src`; returns `src` (as torch returns the sender)."""
        refuse_scalar(x, "recv")
        self._run("recv", False, x, src, tag)
        return src

    def recv_any(self, x: Array, tag: int = 0, async_op: bool = False) -> Any:
        """Receive into `x` from whichever member sends with `tag` first; its group rank (a Work whose result()
        is it when async). As torch's `recv(t)` without `src`."""
        refuse_scalar(x, "recv")
        backend = self.backend
        if backend is None or self._destroyed:
            return self._run("recv", async_op, x, 0, tag)  # raises: not a member, or destroyed

        def receive() -> int:
            try:
                return int(self._tracked("recv", backend.recv_any, x, tag))
            except DistributedError as e:
                if debug():
                    raise
                raise concise(e) from None
        if async_op:
            return self._comm.submit(Work("recv", self.name, self.options.timeout + ASYNC_MARGIN, self._comm), receive)
        self._comm.drain()
        return receive()

    def post_send(self, x: Array, dst: int, tag: int = 0) -> Any:
        """Start sending `x` to group rank `dst` on the calling thread, ahead of the async ops queued on the
        communication thread (a send never waits behind a receive; sends and receives match per peer and tag):
        a `PendingSend` (done once the bytes left), or None once they did. Where the backend cannot post beside
        a running op, the Work of `isend`."""
        backend = self.backend
        if backend is None or not backend.posts_from_any_thread() or self._destroyed:
            return self.isend(x, dst, tag)
        refuse_scalar(x, "isend")
        try:
            return backend.post_send(x, dst, tag)
        except DistributedError as e:
            if debug():
                raise
            raise concise(e) from None

    def isend(self, x: Array, dst: int, tag: int = 0) -> Work:
        """Send asynchronously; the Work completes once the data left this process.

        A transport whose `post_send` only hands the data over does so on the comm thread, so later
        ops (an irecv) run meanwhile.
        """
        refuse_scalar(x, "isend")
        work: Work = self._run("isend", True, x, dst, tag)
        return work

    def irecv(self, x: Array, src: int, tag: int = 0) -> Work:
        """Receive into `x` asynchronously."""
        refuse_scalar(x, "irecv")
        work: Work = self._run("recv", True, x, src, tag)
        return work

    def batch_isend_irecv(self, batch: Sequence[tuple[str, Array, int, int]]) -> list[Any]:
        """Start every ("isend" | "irecv", array, group rank, tag) of `batch` so that no order of them deadlocks;
        their Works in the batch's order (see `axond.batch_isend_irecv`).

        A backend whose `start` launches a batch (nccl: one NCCL group, one Work for all) gets the whole batch;
        otherwise every isend is posted first (they never wait for the receiver), then every irecv.
        """
        for kind, _, peer, _ in batch:  # checked before anything starts
            if kind not in ("isend", "irecv"):
                raise ValueError(f"batch_isend_irecv: unknown op {kind!r} (isend or irecv)")
            if not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"batch_isend_irecv on group '{self.name}': peer {peer!r} is not another member "
                                 f"(group ranks 0..{self.size - 1}, this one is {self.rank})")
        started = self._start_batch(list(batch))
        if started is not None:  # nccl: the whole batch in one NCCL group
            return [started] * len(batch)
        works: list[Any] = [None] * len(batch)
        for i, (kind, x, peer, tag) in enumerate(batch):
            if kind == "isend":
                works[i] = self.isend(x, peer, tag)
        for i, (kind, x, peer, tag) in enumerate(batch):
            if kind == "irecv":
                works[i] = self.irecv(x, peer, tag)
        return works

    def _start_batch(self, batch: list[P2P]) -> Completion | None:
        """The batch launched at once by a backend that tracks completion itself, else None (nothing started)."""
        if self.backend is None or self._destroyed or self._comm.pending:
            return None
        try:
            return self.backend.start("batch_p2p", batch)
        except DistributedError as e:
            if debug():
                raise
            raise concise(e) from None

    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every member entered the barrier."""
        if not async_op:
            return self._fast("barrier", None, None)
        return self._run("barrier", async_op)

    def monitored_barrier(self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through the job's store that names the ranks that did not arrive (a debugging aid).

        Group rank 0 waits `timeout` (default: the group's) for every member; then every member raises
        `DistributedError` naming the first missing rank (all of them with `wait_all_ranks`) and what it
        is blocked in. Works even when the data plane hangs; see `axond.distributed.diagnostics.monitored_barrier`.
        """
        if self._store is None or self.backend is None:
            raise DistributedError(f"monitored_barrier on group '{self.name}': needs a member of a group built "
                                   "from a store", op="monitored_barrier", group=self.name)
        limit = self.timeout if timeout is None else seconds(timeout, "monitored_barrier timeout")
        self._monitored += 1
        self._comm.drain()  # like every blocking call: after the async ops issued before it
        self._tracked("monitored_barrier", monitored_barrier, self._store, self.name, self.rank, self.size,
                      self._monitored, limit, wait_all_ranks, self._describe_peer)

    def new_group(self, ranks: Sequence[int], backend: str | None = None,
                  timeout: float | timedelta | None = None) -> ProcessGroup:
        """Subgroup over `ranks` (global ranks, a subset of this group's). Every member calls it, in the same order.

        `timeout` (seconds) bounds the subgroup's calls; default: this group's.
        """
        if self._store is None:
            raise DistributedError(f"group '{self.name}' has no store to build subgroups from")
        if timeout is not None:
            timeout = seconds(timeout, "new_group timeout")
        wanted = sorted({int(r) for r in ranks})
        if not wanted or len(wanted) != len(list(ranks)):
            raise ValueError(f"new_group needs distinct ranks, got {list(ranks)}")
        strangers = [r for r in wanted if r not in self.ranks]
        if strangers:
            raise ValueError(f"ranks {strangers} are not in group '{self.name}' (ranks {self.ranks})")
        self._subgroups += 1
        members = ",".join(map(str, wanted))
        if len(wanted) > 8:
            members = f"{len(wanted)} ranks {zlib.crc32(members.encode()):08x}"
        name = f"{self.name}/{self._subgroups}[{members}]"
        options = self.options.for_new_group(float(timeout) if timeout is not None else None)
        if self.global_rank not in wanted:
            return ProcessGroup(None, wanted, name, self.global_rank, options)
        kind = backend or self.backend_name
        store = PrefixStore(f"pg/{name}", self._store)
        impl = create_backend(resolve_backend(kind), store, wanted.index(self.global_rank), len(wanted), name, options)
        return ProcessGroup(impl, wanted, name, self.global_rank, options, self._store)


def create_group(store: Store, rank: int, size: int, backend: str = "tcp",
                 options: BackendOptions | None = None, name: str = "world",
                 ranks: Sequence[int] | None = None) -> ProcessGroup:
    """Build one member of a group from a store shared by all members (tests, benchmarks, threads)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside world size {size}")
    options = (options or BackendOptions()).resolved()  # the environment read once, for the group and its subgroups
    members = list(ranks) if ranks is not None else list(range(size))
    impl = create_backend(resolve_backend(backend), PrefixStore(f"pg/{name}", store), rank, size, name, options)
    return ProcessGroup(impl, members, name, members[rank], options, store)
