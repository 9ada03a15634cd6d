"""What every group is below its ops: its members, how one op runs, and its life (`ProcessGroup` adds the ops).

An op runs at once on the calling thread when nothing is queued, or in issue order on the group's communication thread
(`work.OpQueue`); either way this member notes what it is blocked in (the in-flight reporter), counts the time it
waited (`diagnostics.arrivals`), and raises a failure as the user's frames and one line (`diagnostics.failure`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from time import monotonic_ns
from typing import Any

from axond.distributed.backends.base import Backend, BackendOptions, op_methods
from axond.distributed.diagnostics.arrivals import KEEP_MARKS, NOT_COUNTED, Window
from axond.distributed.diagnostics.failure import concise, debug, track, untrack
from axond.distributed.diagnostics.inflight import REPORTER, describe, describe_others
from axond.distributed.fast_path import FastPath
from axond.distributed.membership import surfaced
from axond.distributed.work import OpQueue, Work
from axond.errors import DistributedError
from axond.observe.collectives import instrument
from axond.store import Store

ASYNC_MARGIN = 5.0
"""Seconds beyond the group's timeout that an async op's Work, and the queue's close, wait for it."""


class GroupCore:
    """One process's view of a group over `ranks` (global): its place (`rank`/`size`), how its ops run, its life."""

    def __init__(self, backend: Backend | None, ranks: Sequence[int], name: str, global_rank: int,
                 options: BackendOptions, store: Store | None = None) -> None:
        self.backend = backend
        self._methods = op_methods(backend) if backend is not None else None
        self.ranks = list(ranks)
        self.name = name
        self.global_rank = global_rank
        self.options = options
        self._store = store
        self._comm = OpQueue(name)
        self.fast_path = FastPath(self, backend, self._comm, self._run)
        self._fast = self.fast_path.run
        """The short way of this group's blocking small ops, which every caller takes (`fast_path`)."""
        self._destroyed = False
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.size = len(self.ranks)
        self.timeout = options.timeout
        self.inflight: str | None = None
        """The op this member is running (read by the in-flight reporter: `axond.distributed.diagnostics.inflight`)."""
        self.inflight_seq = 0
        window = options.runtime_env().stragglers.window_ops if backend is not None else 0
        self.window_ops = window
        """Collectives between two arrival marks (0: none recorded; `axond.distributed.diagnostics.arrivals`)."""
        self.waited_ns = 0
        """Nanoseconds this member spent inside its blocking collectives (p2p ops not counted), from enter to done."""
        self.waited_ops = 0
        """How many collectives `waited_ns` sums."""
        self.window_at = window if window > 0 else 1 << 62
        self.windows: deque[Window] = deque(maxlen=KEEP_MARKS)
        """The last marks, one every `window_ops` collectives: (number, waited_ns then, time.monotonic_ns() then)."""
        if backend is not None:
            track(self)
            if options.runtime_env().observe.active:  # metrics or timeline on: time this group's collectives
                instrument(self)
        if backend is not None and store is not None:
            REPORTER.register(store, global_rank, self)
            backend.explain_timeouts(self._describe_peer, self._describe_peers)

    def _describe_peer(self, group_rank: int) -> str:
        """What peer `group_rank` published about the op it is blocked in (for timeout messages)."""
        assert self._store is not None
        mine = (self.name, self.inflight) if self.inflight is not None else None
        return describe(self._store, self.ranks[group_rank], group_rank, self.timeout, mine)

    def _describe_peers(self, op: str) -> str:
        """Which members are not in `op` on this group, and what they report instead (for NCCL timeouts)."""
        assert self._store is not None
        return describe_others(self._store, list(self.ranks), self.rank, self.timeout, (self.name, op))

    def __repr__(self) -> str:
        kind = self.backend.name if self.backend is not None else "non-member"
        return f"ProcessGroup({self.name!r}, rank={self.rank}, size={self.size}, ranks={self.ranks}, backend={kind})"

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else "none"

    def contains(self, global_rank: int) -> bool:
        """Whether `global_rank` is a member of this group."""
        return global_rank in self.ranks

    def group_rank(self, global_rank: int) -> int:
        """Group-local rank of `global_rank`, or ValueError naming the members."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"global rank {global_rank} is not in group '{self.name}' (ranks {self.ranks})") from None

    def global_rank_of(self, group_rank: int) -> int:
        """Global rank of group-local `group_rank`."""
        return self.ranks[group_rank]

    def _run(self, op: str, async_op: bool, *args: Any, **kwargs: Any) -> Any:
        """Run op `op` (a key of `op_methods`) now, or started in issue order when `async_op`.

        A backend that tracks completion itself (`Backend.start`, e.g. CUDA events on the group's stream)
        launches async ops itself; the others run them on the group's communication thread.
        """
        try:
            methods = self._methods
            if not async_op and methods is not None and not self._comm.pending and not self._destroyed:
                self.inflight = op  # the common case, kept short: small ops are latency-bound
                self.inflight_seq += 1
                start = monotonic_ns()
                try:
                    return methods[op](*args, **kwargs)
                finally:
                    self.inflight = None
                    if op not in NOT_COUNTED:  # a few adds: the time waited, for naming stragglers
                        self.waited_ns += monotonic_ns() - start
                        self.waited_ops += 1
                        if self.waited_ops >= self.window_at:
                            self.close_window()
            return self._start(op, async_op, *args, **kwargs)
        except DistributedError as e:
            error = surfaced(e, self.abort)  # a live job: MembershipChanged once the worker says the job moved on
            if debug():
                if error is e:
                    raise
                raise error from e
            # the user's frames and one line (AXOND_DEBUG=1 keeps the transport's frames and chain)
            raise concise(error) from None

    def _start(self, op: str, async_op: bool, *args: Any, **kwargs: Any) -> Any:
        """`_run` past its common case (a blocking op with nothing pending): async, destroyed or not a member."""
        methods = self._methods
        if self._destroyed:
            raise DistributedError(f"{op} on group '{self.name}': the group was destroyed; create a new one",
                                   op=op, group=self.name, rank=self.rank)
        if self.backend is None or methods is None:
            raise DistributedError(f"{op} on group '{self.name}': global rank {self.global_rank} is not a member "
                                   f"(ranks {self.ranks}); only members may use it", op=op, group=self.name)
        call = methods[op]
        if async_op:
            if not self._comm.pending:
                started = self.backend.start(op, *args, **kwargs)
                if started is not None:
                    return started
            work = Work(op, self.name, self.options.timeout + ASYNC_MARGIN, self._comm)
            return self._comm.submit(work, lambda: self._tracked(op, call, *args, **kwargs))
        self._comm.drain()
        return self._tracked(op, call, *args, **kwargs)

    def _tracked(self, op: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        self.inflight = op
        self.inflight_seq += 1
        start = monotonic_ns()
        try:
            return call(*args, **kwargs)
        finally:
            self.inflight = None
            if op not in NOT_COUNTED:
                self.waited_ns += monotonic_ns() - start
                self.waited_ops += 1
                if self.waited_ops >= self.window_at:
                    self.close_window()

    def close_window(self) -> None:
        """Keep a mark (every `window_ops` collectives): its number, the wait so far, now."""
        self.windows.append((self.waited_ops // self.window_ops, self.waited_ns, monotonic_ns()))
        self.window_at += self.window_ops

    def abort(self, reason: str) -> None:
        """Tell the other members this rank gave up (`reason`), so they raise instead of waiting.

        For failures outside a collective (a stage's own exception in a pipeline): peers blocked on
        this rank get `DistributedError` quoting `reason` at once, not after their timeout. Later ops
        on this group raise; `destroy()` still releases it.
        """
        if self.backend is not None and not self._destroyed:
            self.backend.abort(reason)

    def interrupt(self, reason: str) -> None:
        """End this rank's blocked and later ops on the group at once, from any thread: the peers are told as by
        `abort`, and ops blocked on a peer that will never answer (its link cut) raise `DistributedError` quoting
        `reason` instead of waiting for the timeout. Live recovery's watcher calls it (`axond.distributed.live_watch`).
        """
        if self.backend is not None and not self._destroyed:
            self.backend.interrupt(reason)

    def destroy(self) -> None:
        """Finish queued async ops, then close sockets and threads; idempotent."""
        self._destroyed = True
        self.fast_path.close()
        untrack(self)
        self._comm.close(self.options.timeout + ASYNC_MARGIN)
        if self.backend is not None:
            if self._store is not None:
                REPORTER.unregister(self._store, self.global_rank, self)
            self.backend.close()
