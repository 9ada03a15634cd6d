"""Form real groups of threads or processes on loopback, without a worker launch (tests, benchmarks).

Both helpers join every rank with a timeout and re-raise the first rank's failure with its
traceback, naming the rank. Threads can also form groups on the network-free "mock" backend
(`run_threads(fn, n, backend="mock")`), which opens no socket; see docs/testing.md.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from axond.distributed.backends.base import BackendOptions
from axond.distributed.failure import abort_group, report
from axond.distributed.file_store import FileStore
from axond.distributed.process_group import ProcessGroup, create_group
from axond.errors import AxondError
from axond.store import InMemoryStore, Store

__all__ = ["FileStore", "RankFailed", "collect_from_processes", "node_hosts", "run_module_ranks", "run_on",
           "run_processes", "run_threads", "thread_groups"]


class RankFailed(AxondError):
    """A rank started by `run_threads`/`run_processes` failed or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def _start_and_join(body: Callable[[int], None], n: int, timeout: float) -> tuple[list[threading.Thread], list[int]]:
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
    failing rank aborts its group with the cause, as a failing process does (see `axond.distributed.failure`),
    so the ranks waiting for it raise instead of timing out.
    """
    store = store if store is not None else InMemoryStore()
    options = options or BackendOptions(timeout=min(timeout, 30.0))
    results: list[Any] = [None] * world_size
    errors: list[tuple[float, int, BaseException, str]] = []
    groups: list[ProcessGroup | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            pg = groups[rank] = create_group(store, rank, world_size, backend, options)
            results[rank] = fn(pg)
        except BaseException as e:
            errors.append((time.monotonic(), rank, e, traceback.format_exc()))
            failed = groups[rank]
            if failed is not None:
                abort_group(failed, e)
        finally:
            made = groups[rank]
            if made is not None:
                made.destroy()

    threads, stuck = _start_and_join(body, world_size, timeout)
    if stuck:
        for r in stuck:
            pg = groups[r]
            if pg is not None and pg.backend is not None:
                pg.backend.close()
        for r in stuck:
            threads[r].join(5.0)
        raise RankFailed(f"ranks {stuck} of {world_size} did not finish within {timeout:.1f} s", stuck[0])
    if errors:
        _, rank, error, tb = min(errors, key=lambda e: e[0])
        raise RankFailed(f"rank {rank} of {world_size} failed: {error}\n{tb}", rank) from error
    return results


def thread_groups(world_size: int, timeout: float = 10.0, options: BackendOptions | Sequence[BackendOptions] | None = None,
                  backend: str = "tcp", hosts: Sequence[str] | None = None) -> list[ProcessGroup]:
    """Build the `world_size` members of one group in this process (one thread each), for explicit tests.

    `options`: every member's, or one per rank (e.g. to give one member other settings than the rest).

    `hosts`: the address each rank listens on and advertises, e.g. `node_hosts(4, 2)`: ranks advertising
    different loopback addresses count as members on different nodes (see `axond.distributed.backends.tcp.hierarchy.topology`).
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

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(per_rank[0].timeout + 5.0)
    if errors or any(g is None for g in out):
        for g in out:
            if g is not None:
                g.destroy()
        raise RankFailed(f"could not form a group of {world_size} threads: {errors[:1]}")
    return [g for g in out if g is not None]


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
    errors: list[tuple[float, int, BaseException, str]] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(groups[i])
        except BaseException as e:
            errors.append((time.monotonic(), i, e, traceback.format_exc()))
            if return_exceptions:
                results[i] = e

    _, stuck = _start_and_join(body, len(groups), timeout)
    if stuck:
        raise RankFailed(f"ranks {stuck} of {len(groups)} did not finish within {timeout:.1f} s", stuck[0])
    if errors and not return_exceptions:
        _, rank, error, tb = min(errors, key=lambda e: e[0])
        raise RankFailed(f"rank {rank} of {len(groups)} failed: {error}\n{tb}", rank) from error
    return results


def _process_main(fn: Callable[[], Any], rank: int, size: int, store_dir: str, backend: str, timeout: float,
                  env: Mapping[str, str], results: Any) -> None:
    import axond

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
            return _run_module(fn_or_module, world_size, timeout, store_dir, args, env)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_process_main, args=(fn_or_module, r, world_size, store_dir, backend,
                                                         op_timeout, dict(env or {}), results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any, str]] = {}
        failures: list[tuple[float, int, Any, str]] = []
        """(when, rank, what, traceback): the earliest is reported (the others are usually its consequences)."""
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value, tb, when = results.get(timeout=0.1)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                    failures += [(time.time(), r, f"exit code {procs[r].exitcode}", "") for r in dead]
                    got.update({r: (False, None, "") for r in dead})
                    continue
                got[rank] = (ok, value, tb)
                if not ok:
                    failures.append((when, rank, value, tb))
        finally:
            for p in procs:
                p.join(max(0.0, min(5.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
        if failures:
            _, rank, what, tb = min(failures, key=lambda f: f[0])
            raise RankFailed(f"rank {rank} of {world_size} failed: {what}\n{tb}", rank)
        missing = [r for r in range(world_size) if r not in got]
        if missing:
            raise RankFailed(f"ranks {missing} of {world_size} did not finish within {timeout:.1f} s", missing[0])
        return [got[r][1] for r in range(world_size)]


def _rank_env(rank: int, world_size: int, store_dir: str, env: Mapping[str, str] | None) -> dict[str, str]:
    child = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world_size), AXOND_FILE_STORE=store_dir)
    child.pop("AXOND_COORDINATOR", None)
    return child


def _run_module(module: str, world_size: int, timeout: float, store_dir: str, args: Sequence[str],
                env: Mapping[str, str] | None) -> list[int]:
    procs = []
    for r in range(world_size):
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=_rank_env(r, world_size, store_dir, env),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [out for out, _ in _communicate_all(procs, timeout)]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RankFailed(f"rank {r} of {world_size} ({module}) exited with {p.returncode}:\n{outputs[r][-4000:]}", r)
    return [p.returncode for p in procs]


def run_module_ranks(module: str, world_size: int, timeout: float = 60.0, *, args: Sequence[str] = (),
                     env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None
                     ) -> list[subprocess.CompletedProcess[str]]:
    """Run `python -m module args...` as `world_size` ranks sharing a FileStore, as `run_processes` does, and
    return each rank's exit code, stdout and stderr without judging them (for tests of failing ranks).

    `env`: added to every rank's environment, or one mapping per rank. Ranks still running after `timeout`
    are killed (their return code is then negative)."""
    envs = [env] * world_size if env is None or isinstance(env, Mapping) else list(env)
    with tempfile.TemporaryDirectory(prefix="axond-store-") as store_dir:
        procs = [subprocess.Popen([sys.executable, "-m", module, *args], env=_rank_env(r, world_size, store_dir, envs[r]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world_size)]
        outputs = _communicate_all(procs, timeout)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def _communicate_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it exits; those still running after `timeout` (shared) are killed."""
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate(timeout=5.0)
            outputs.append((out or "", err or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5.0)
    return outputs


def collect_from_processes(target: Callable[..., None], world_size: int, expect: int,
                           timeout: float = 60.0) -> tuple[list[Any], list[int | None]]:
    """For tests where ranks die on purpose: run `target(rank, world_size, store_dir, queue)` in `world_size`
    spawned processes sharing a FileStore directory, take `expect` items from the queue (each within
    `timeout`), then join every process (killing any still alive after 10 s); returns the items and the
    processes' exit codes (a negative code is the signal that ended it)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="axond-store-") as store_dir:
        procs = [ctx.Process(target=target, args=(r, world_size, store_dir, q), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            items = [q.get(timeout=timeout) for _ in range(expect)]
        finally:
            for p in procs:
                p.join(10.0)
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
    return items, [p.exitcode for p in procs]
