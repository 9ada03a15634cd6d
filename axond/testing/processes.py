"""Ranks as processes on loopback (forked from a fork server, or spawned): `run_processes` (a function after
`init_process_group`, or a module) and `collect_from_processes` (for ranks that die on purpose)."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.context
import multiprocessing.process
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from axond.distributed.diagnostics.failure import report
from axond.store.file import FileStore
from axond.testing.failures import Failure, not_finished, raise_earliest
from axond.testing.module_ranks import run_module
from axond.testing.waits import join_or_kill
import axond

POLL = 0.1
"""Seconds between looks at the ranks' exit codes while waiting for their results."""
PRELOAD = ("numpy", "axond", "axond.testing")
"""What the fork server imports once: every rank forked from it starts with these loaded, instead of starting an
interpreter and importing them (about half a second a rank on two cores). Where there is no fork server, ranks
are spawned."""


def _context() -> multiprocessing.context.BaseContext:
    """The fork server (started at the first use, with PRELOAD imported), or spawning where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Output:
    """The starter's stdout and stderr, passed to a rank as the same open files (a rank forked from the fork
    server otherwise writes to the server's, those of whoever started the server)."""

    def __init__(self, fds: tuple[Any, ...] = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _Output, ((reduction.DupFd(1), reduction.DupFd(2)),)  # sent with the process (SCM_RIGHTS)

    def install(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            got = fd.detach()
            os.dup2(got, target)
            os.close(got)


def _as_started_now(output: _Output, environ: Mapping[str, str], target: Callable[..., Any], *args: Any) -> None:
    """Run `target(*args)` with the starter's stdout, stderr and environment as they were when it started this rank
    (multiprocessing itself passes the directory, sys.path and main module): under pytest, a rank's output lands in
    what is captured for the test that started it."""
    output.install()
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def _process(ctx: multiprocessing.context.BaseContext, target: Callable[..., Any], *args: Any
             ) -> multiprocessing.process.BaseProcess:
    """A daemon rank process of `ctx` running `target(*args)` as if spawned now."""
    now = (_Output(), dict(os.environ))
    return ctx.Process(target=_as_started_now, args=(*now, target, *args), daemon=True)  # type: ignore[attr-defined]


def _process_main(fn: Callable[[], Any], rank: int, size: int, store_dir: str, backend: str, timeout: float,
                  env: Mapping[str, str], results: Any) -> None:
    """A rank's process: join the group, run `fn`, put (rank, ok, value or repr, traceback, when) on `results`."""
    try:
        os.environ.update(env)
        store = None if "AXOND_COORDINATOR" in env else FileStore(store_dir)
        axond.init_process_group(backend, timeout, rank=rank, world_size=size, store=store, local_rank=rank)
        try:
            value = fn()
        except BaseException as e:
            results.put((rank, False, repr(e), traceback.format_exc(), time.time()))
            report(e)  # the peers raise with this cause, as for an uncaught exception
            return
        finally:
            axond.destroy_process_group()
        results.put((rank, True, value, "", time.time()))
    except BaseException as e:
        results.put((rank, False, repr(e), traceback.format_exc(), time.time()))


def run_processes(fn_or_module: Callable[[], Any] | str, world_size: int, timeout: float = 60.0, *,
                  backend: str = "tcp", op_timeout: float | None = None, args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None) -> list[Any]:
    """Start `world_size` real processes on loopback and return their results by rank.

    `fn_or_module` is a picklable function (run after `init_process_group`, its return value sent
    back) or a module name run as `python -m module args...` with RANK, WORLD_SIZE, LOCAL_RANK and
    AXOND_FILE_STORE set (returns exit codes). `env` is added to each rank's environment; with
    AXOND_COORDINATOR in it, ranks use the coordinator's store. Stuck ranks are killed after `timeout`.
    """
    op_timeout = op_timeout if op_timeout is not None else min(timeout, 30.0)
    with tempfile.TemporaryDirectory(prefix="axond-store-") as store_dir:
        if isinstance(fn_or_module, str):
            return run_module(fn_or_module, world_size, timeout, store_dir, args, env)
        return _run_function(fn_or_module, world_size, timeout, store_dir, backend, op_timeout, dict(env or {}))


def _run_function(fn: Callable[[], Any], world_size: int, timeout: float, store_dir: str, backend: str,
                  op_timeout: float, env: dict[str, str]) -> list[Any]:
    """`fn` in `world_size` spawned ranks; their results by rank, or `RankFailed` for the earliest failure."""
    ctx = _context()
    results = ctx.Queue()
    procs = [_process(ctx, _process_main, fn, r, world_size, store_dir, backend, op_timeout, env, results)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        got, failures = _collect_results(results, procs, deadline)
    finally:
        join_or_kill(procs, 5.0, deadline)
    raise_earliest(failures, world_size)
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        raise not_finished(missing, world_size, timeout)
    return [got[r] for r in range(world_size)]


def _collect_results(results: Any, procs: Sequence[multiprocessing.process.BaseProcess], deadline: float
                     ) -> tuple[dict[int, Any], list[Failure]]:
    """Take the ranks' reports from `results` until every rank has reported or exited with an error, or
    `deadline` passes; returns (result by rank that ended, failures)."""
    got: dict[int, Any] = {}
    failures: list[Failure] = []
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value, tb, when = results.get(timeout=POLL)
        except queue.Empty:
            for r in _died(procs, got):
                got[r] = None
                failures.append(Failure(time.time(), r, f"exit code {procs[r].exitcode}", ""))
            continue
        got[rank] = value if ok else None
        if not ok:
            failures.append(Failure(when, rank, value, tb))
    return got, failures


def _died(procs: Sequence[multiprocessing.process.BaseProcess], reported: Mapping[int, Any]) -> list[int]:
    """The ranks that exited with an error without reporting."""
    return [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]


def collect_from_processes(target: Callable[..., None], world_size: int, expect: int,
                           timeout: float = 60.0) -> tuple[list[Any], list[int | None]]:
    """For tests where ranks die on purpose: run `target(rank, world_size, store_dir, queue)` in `world_size`
    spawned processes sharing a FileStore directory, take `expect` items from the queue (each within
    `timeout`), then join every process (killing any still alive after 10 s); returns the items and the
    processes' exit codes (a negative code is the signal that ended it)."""
    ctx = _context()
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="axond-store-") as store_dir:
        procs = [_process(ctx, target, r, world_size, store_dir, q) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            items = [q.get(timeout=timeout) for _ in range(expect)]
        finally:
            join_or_kill(procs, 10.0)
    return items, [p.exitcode for p in procs]
