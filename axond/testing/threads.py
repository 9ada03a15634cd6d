"""Ranks as threads of this process: form groups (`thread_groups`), run a function on them (`run_on`), or both
at once on fresh groups (`run_threads`), over loopback sockets ("tcp") or none at all ("mock")."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from axond.distributed.backends.base import BackendOptions
from axond.distributed.diagnostics.failure import abort_group
from axond.distributed.process_group import ProcessGroup, create_group
from axond.store import InMemoryStore, Store
from axond.testing.failures import Failure, RankFailed, not_finished, raise_earliest


def start_and_join(body: Callable[[int], None], n: int, timeout: float) -> tuple[list[threading.Thread], list[int]]:
    """Run `body(rank)` on `n` daemon threads; join them all by one deadline; return (threads, ranks still running)."""
    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return threads, [r for r, t in enumerate(threads) if t.is_alive()]


def run_threads(fn: Callable[[ProcessGroup], Any], world_size: int, timeout: float = 60.0, *,
                backend: str = "tcp", options: BackendOptions | None = None, store: Store | None = None) -> list[Any]:
    """Run `fn(group)` on `world_size` threads, each the member of a fresh group; return results by rank.

    `backend="mock"` joins the threads in this process without any socket (unit tests); "tcp" over loopback.
    The first failure is re-raised as `RankFailed` (chained to the original, traceback in the message). A
    failing rank aborts its group with the cause, as a failing process does (see
    `axond.distributed.diagnostics.failure`), so the ranks waiting for it raise instead of timing out.
    """
    store = store if store is not None else InMemoryStore()
    options = options or BackendOptions(timeout=min(timeout, 30.0))
    results: list[Any] = [None] * world_size
    failures: list[Failure] = []
    groups: list[ProcessGroup | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            pg = groups[rank] = create_group(store, rank, world_size, backend, options)
            results[rank] = fn(pg)
        except BaseException as e:
            failures.append(Failure.caught(rank, e))
            _abort(groups[rank], e)
        finally:
            _destroy(groups[rank])

    threads, stuck = start_and_join(body, world_size, timeout)
    if stuck:
        _close_stuck(threads, groups, stuck)
        raise not_finished(stuck, world_size, timeout)
    raise_earliest(failures, world_size)
    return results


def _abort(group: ProcessGroup | None, cause: BaseException) -> None:
    if group is not None:
        abort_group(group, cause)


def _destroy(group: ProcessGroup | None) -> None:
    if group is not None:
        group.destroy()


def _close_stuck(threads: Sequence[threading.Thread], groups: Sequence[ProcessGroup | None],
                 stuck: Sequence[int]) -> None:
    """Close the backends of the ranks `stuck` (their blocked calls then raise) and give their threads 5 s to end."""
    for r in stuck:
        pg = groups[r]
        if pg is not None and pg.backend is not None:
            pg.backend.close()
    for r in stuck:
        threads[r].join(5.0)


def thread_groups(world_size: int, timeout: float = 10.0,
                  options: BackendOptions | Sequence[BackendOptions] | None = None,
                  backend: str = "tcp", hosts: Sequence[str] | None = None) -> list[ProcessGroup]:
    """Build the `world_size` members of one group in this process (one thread each), for explicit tests.

    `timeout`: seconds each call on the groups may block, unless `options` say otherwise.
    `options`: every member's, or one per rank (e.g. to give one member other settings than the rest).
    `hosts`: the address each rank listens on and advertises, e.g. `node_hosts(4, 2)`: ranks advertising
    different loopback addresses count as members on different nodes (see
    `axond.distributed.backends.tcp.hierarchy.topology`).
    """
    store = InMemoryStore()
    given = options or BackendOptions(timeout=timeout)
    per_rank = [given] * world_size if isinstance(given, BackendOptions) else list(given)
    out: list[ProcessGroup | None] = [None] * world_size
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            mine = per_rank[rank] if hosts is None else dataclasses.replace(per_rank[rank], host=hosts[rank])
            out[rank] = create_group(store, rank, world_size, backend, mine)
        except BaseException as e:
            errors.append(e)

    longest = max(timeout, *(o.timeout for o in per_rank))
    start_and_join(make, world_size, longest + 5.0)  # formation gives up by options.timeout
    formed = [g for g in out if g is not None]
    if errors or len(formed) < world_size:
        for g in formed:
            g.destroy()
        raise RankFailed(f"could not form a group of {world_size} threads: {errors[:1]}")
    return formed


def node_hosts(world_size: int, nodes: int) -> list[str]:
    """Loopback addresses that put rank r on node r % nodes (127.0.0.1, 127.0.0.2, ...): members of one
    node are not consecutive ranks, as with a round-robin launch."""
    return [f"127.0.0.{1 + r % nodes}" for r in range(world_size)]


def run_on(groups: Sequence[ProcessGroup], fn: Callable[[ProcessGroup], Any], timeout: float = 30.0,
           return_exceptions: bool = False) -> list[Any]:
    """Run `fn(group)` concurrently for every member in `groups` (one thread each); results by rank.

    Re-raises the earliest failure as `RankFailed` (or, with `return_exceptions`, puts each rank's
    exception in its result slot); members still running after `timeout` are reported.
    """
    results: list[Any] = [None] * len(groups)
    failures: list[Failure] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(groups[i])
        except BaseException as e:
            failures.append(Failure.caught(i, e))
            if return_exceptions:
                results[i] = e

    _, stuck = start_and_join(body, len(groups), timeout)
    if stuck:
        raise not_finished(stuck, len(groups), timeout)
    if not return_exceptions:
        raise_earliest(failures, len(groups))
    return results
