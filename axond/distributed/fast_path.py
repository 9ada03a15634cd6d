"""The short way of a blocking op, decided once per (group, op signature) and taken by every caller.

Small ops cost mostly latency. A backend may keep a prepared form of a blocking op it ran the full way (tcp: a small
op through its shared mailbox, `Backend.prepared`): a runner that takes the op's method arguments and runs it past the
checks and the route, or returns `MISSED` having done nothing (the form went stale, or an argument it does not take;
the full way then checks and raises as it should). `FastPath` keeps each runner under the op's signature
(`backends.base.signature`) and runs it for the next blocking call of that signature while no async op is queued.
Every `ProcessGroup` method with a short way (`all_reduce`, `broadcast`, `all_gather`, `reduce_scatter`, `barrier`)
calls `FastPath.run`, and every caller (the module functions, the torch backend, the parallel wrappers) calls those
methods: there is no other short way.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic_ns
from typing import Any

from axond.distributed.backends.base import MISSED, Backend, Signature
from axond.distributed.diagnostics.failure import concise, debug
from axond.distributed.work import OpQueue
from axond.distributed.membership import surfaced
from axond.errors import DistributedError

SIGNATURES = 64
"""Prepared signatures kept per group; all dropped when full (a program cycles through a few shapes)."""


class FastPath:
    """The prepared runners of one group's blocking ops by signature, and the one place they run.

    `owner` is the group: its `inflight`/`inflight_seq` say what this member runs (the in-flight reporter), its
    `waited_ns`/`waited_ops` count the time spent in collectives (`axond.distributed.diagnostics.arrivals`), and
    `full(op, async_op, *args)` runs an op the full way (`ProcessGroup._run`).
    """

    __slots__ = ("_backend", "_comm", "_full", "_owner", "_runners")

    def __init__(self, owner: Any, backend: Backend | None, comm: OpQueue, full: Callable[..., Any]) -> None:
        self._owner = owner
        self._backend = backend
        self._comm = comm
        self._full = full
        self._runners: dict[Signature, Callable[..., Any]] = {}

    def __len__(self) -> int:
        """How many signatures run the short way now."""
        return len(self._runners)

    def run(self, op: str, x: Any, arg: Any, *args: Any) -> Any:
        """Run blocking op `op` with its method's `args`: the short way if its signature (`x`, `arg`) has a runner and
        no async op is queued, else the full way, after which the backend's prepared form (if any) is kept."""
        try:
            key = (op, x.dtype, x.size, arg) if x is not None else (op, None, None, None)  # `signature`, inlined
            runner = self._runners.get(key)
        except TypeError:  # an unhashable argument: the full way says what is wrong with it
            return self._full(op, False, *args)
        if runner is not None and not self._comm.pending:
            owner = self._owner
            owner.inflight = op
            owner.inflight_seq += 1
            start = monotonic_ns()
            try:
                result = runner(*args)
            except DistributedError as e:
                error = surfaced(e, owner.abort)
                if debug():
                    if error is e:
                        raise
                    raise error from e
                raise concise(error) from None  # the user's frames and one line, as `ProcessGroup._run`
            finally:
                owner.inflight = None
            if result is not MISSED:
                owner.waited_ns += monotonic_ns() - start  # the time waited, as `ProcessGroup._run` counts it
                owner.waited_ops += 1
                if owner.waited_ops >= owner.window_at:
                    owner.close_window()
                return result
        result = self._full(op, False, *args)
        backend = self._backend
        if backend is not None:
            prepared = backend.prepared(key)
            if prepared is not None:
                if len(self._runners) >= SIGNATURES:
                    self._runners.clear()
                self._runners[key] = prepared
        return result

    def runners(self) -> dict[Signature, Callable[..., Any]]:
        """The runners by signature (a copy): what runs the short way now."""
        return dict(self._runners)

    def clear(self) -> None:
        """Drop every runner: the next call of each signature takes the full way (and prepares again)."""
        self._runners.clear()

    def close(self) -> None:
        """Drop every runner and prepare no more: the group was destroyed (its next op takes the full way, which
        raises)."""
        self._runners.clear()
        self._backend = None
