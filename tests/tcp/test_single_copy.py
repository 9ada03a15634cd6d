"""The tcp backend's single-copy path between ranks on one host (each rank reads its peers' buffers with
process_vm_readv): when it is taken, that every member agrees on it (or the group uses the arena), rank-order
numbers, buffer reuse across ops, failures on every rank, and real processes (threads share a pid).

Every collective also runs through it in test_collectives (transport "single_copy": published over the sockets);
here it also publishes through the mailbox.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond
from axond import DistributedError, ProcessGroup
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import ORDERED_STORES
from axond.distributed.backends.tcp.shm import single_copy
from axond.distributed.backends.tcp.policy import SINGLE_COPY_CHUNK_BYTES as CHUNK_BYTES
from axond.testing import collect_from_processes, run_on, run_processes, thread_groups
from collective_cases import all_reduce_until_killed, check_every_large_op, check_killed_rank_1, every_large_op

MiB = 1 << 20
EVERY_OP = TcpOptions(shm_min_bytes=0)
"""Every op above the mailbox's 4 KiB on the single-copy path, published through the mailbox (where x86 has one)."""

pytestmark = pytest.mark.skipif(single_copy.local_obstacle() is not None,
                                reason=f"single copy unavailable here: {single_copy.local_obstacle()}")


def single_copy_of(pg: ProcessGroup) -> Any:
    return pg.backend.placement.single_copy  # type: ignore[union-attr]


def groups(n: int, tcp: TcpOptions = EVERY_OP, timeout: float = 10.0) -> list[ProcessGroup]:
    return thread_groups(n, options=BackendOptions(timeout=timeout, tcp=tcp))


def test_large_ops_take_it_by_default_once_set_up_and_small_ones_do_not(made: list[ProcessGroup],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AXOND_DEBUG", "1")
    made += groups(2, TcpOptions())
    run_on(made, lambda pg: pg.all_reduce(np.ones(500)))  # the mailbox's
    assert all(single_copy_of(pg) is None and not pg.backend.placement.single_copy_tried for pg in made)  # type: ignore[union-attr]
    out = run_on(made, lambda pg: (lambda x: pg.broadcast(x, 1) or x)(np.full(2 * MiB, pg.rank + 1.0)))  # 16 MiB
    assert all((x == 2.0).all() for x in out)
    sc = [single_copy_of(pg) for pg in made]
    assert all(s is not None for s in sc) and all(pg.backend.placement.arena is None for pg in made)  # type: ignore[union-attr]
    assert all((pg.backend.placement.mailbox is not None) == ORDERED_STORES for pg in made)  # type: ignore[union-attr]
    run_on(made, lambda pg: pg.all_gather(np.ones(1 << 16)))
    assert [single_copy_of(pg) for pg in made] == sc  # set up once per group
    err = capfd.readouterr().err
    assert err.count("large ops on one host take the single-copy path (process_vm_readv)") == 2, err


def test_a_member_that_cannot_read_keeps_the_whole_group_on_the_arena(made: list[ProcessGroup],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """One member refused (as Yama ptrace_scope 2 or a missing CAP_SYS_PTRACE would): every member takes the arena."""
    monkeypatch.setenv("AXOND_DEBUG", "1")
    calls: list[int] = []

    def refused_once(scope_path: str = single_copy.YAMA_SCOPE) -> str | None:
        calls.append(1)
        return "Yama ptrace_scope is 2 (test)" if len(calls) == 1 else None
    monkeypatch.setattr(single_copy, "local_obstacle", refused_once)
    made += groups(3)
    out = run_on(made, lambda pg: (lambda x: pg.all_reduce(x) or x)(np.full(MiB // 8, pg.rank + 1.0)))
    assert all((x == 6.0).all() for x in out) and len(calls) == 3
    assert all(single_copy_of(pg) is None and pg.backend.placement.arena is not None for pg in made)  # type: ignore[union-attr]
    err = capfd.readouterr().err
    assert err.count("large ops on one host take the arena") == 3 and "ptrace_scope is 2 (test)" in err, err


def test_yama_scope_above_one_rules_it_out(tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    scope.write_text("2\n")
    assert single_copy.local_obstacle(str(scope)) == f"Yama ptrace_scope is 2 ({scope})"
    scope.write_text("3\n")
    assert "ptrace_scope is 3" in str(single_copy.local_obstacle(str(scope)))
    scope.write_text("0\n")
    assert single_copy.local_obstacle(str(scope)) is None
    assert single_copy.local_obstacle(str(tmp_path / "absent")) is None  # no Yama


def test_axond_shm_single_copy_0_keeps_the_arena(made: list[ProcessGroup], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_SHM_SINGLE_COPY", "0")
    made += thread_groups(2, timeout=10.0)
    run_on(made, lambda pg: pg.broadcast(np.ones(2 * MiB), 0))  # 16 MiB
    assert all(single_copy_of(pg) is None and pg.backend.placement.arena is not None for pg in made)  # type: ignore[union-attr]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("mailbox", [True, False])
def test_sums_are_those_of_one_process_adding_in_rank_order(made: list[ProcessGroup], size: int,
                                                            mailbox: bool) -> None:
    """Random floats over several chunks per part: every rank gets exactly ((x0 + x1) + x2) + ..., the parity of a
    single process, from all_reduce and reduce_scatter alike."""
    made += groups(size, TcpOptions(shm_min_bytes=0, shm_mailbox=mailbox))
    count = 3 * size * CHUNK_BYTES // 4 + 7  # three chunks per part and a ragged end
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(size)]
    want = functools.reduce(np.add, inputs)

    def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray]:
        x = inputs[pg.rank].copy()
        pg.all_reduce(x)
        return x, pg.reduce_scatter(inputs[pg.rank][: count - count % size].copy())

    block = (count - count % size) // size
    for r, (got, part) in enumerate(run_on(made, body)):
        assert got.tobytes() == want.tobytes()
        assert part.tobytes() == want[r * block : (r + 1) * block].tobytes()
    assert all(single_copy_of(pg) is not None for pg in made)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_back_to_back_ops_and_async_queues_never_read_a_reused_buffer(made: list[ProcessGroup], size: int) -> None:
    """Ops of every kind, blocking and queued, where each rank reuses and overwrites its buffers at once after an op
    returns; a rank sleeps at times to let the others run ahead."""
    made += groups(size, timeout=20.0)
    rounds = 6

    def body(pg: ProcessGroup) -> list[Any]:
        r, n = pg.rank, pg.size
        rng = np.random.default_rng(r)
        got: list[Any] = []
        a = np.empty(40_001, np.int64)  # past the mailbox: the single-copy path
        for i in range(rounds):
            if rng.random() < 0.3:
                time.sleep(0.01)
            a[...] = r + i
            works = [pg.all_reduce(a, async_op=True)]
            b = np.full(5_003 + i, r * 10 + i, np.int32)
            gathered = pg.all_gather(b)
            c = np.arange(n * 3_001, dtype=np.float64) * (r + 1) + i
            scattered = pg.reduce_scatter(c)
            d = np.full(7_777, i, np.int16) if r == i % n else np.zeros(7_777, np.int16)
            works.append(pg.broadcast(d, i % n, async_op=True))
            assert all(w is not None and w.wait(20.0) for w in works)
            got.append((a.copy(), gathered, scattered, d))
        return got

    for r, got in enumerate(run_on(made, body, timeout=60.0)):
        for i, (a, gathered, scattered, d) in enumerate(got):
            assert (a == sum(k + i for k in range(size))).all(), (r, i)
            assert (gathered == (np.arange(size) * 10 + i)[:, None]).all(), (r, i)
            full = functools.reduce(np.add, [np.arange(size * 3_001, dtype=np.float64) * (k + 1) + i
                                             for k in range(size)])
            np.testing.assert_array_equal(scattered, full[r * 3_001 : (r + 1) * 3_001])
            assert (d == i).all(), (r, i)
    assert all(single_copy_of(pg) is not None for pg in made)


@pytest.mark.parametrize("mailbox", [True, False])  # published through the mailbox / over the sockets
def test_mismatched_calls_raise_on_every_rank_naming_both_sides(made: list[ProcessGroup], mailbox: bool) -> None:
    tcp = TcpOptions(shm_min_bytes=0, shm_mailbox=mailbox)
    made += (gs := groups(2, tcp, timeout=5.0))
    run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))
    assert all(single_copy_of(pg) is not None for pg in gs)

    def body(pg: ProcessGroup) -> None:
        pg.all_reduce(np.ones(100_000 if pg.rank == 0 else 120_000, np.float32))
    for e in run_on(gs, body, return_exceptions=True):
        assert isinstance(e, DistributedError), e
        assert "(float32, 100000 elements)" in str(e) and "(float32, 120000 elements)" in str(e), e

    made += (gs := groups(2, tcp, timeout=5.0))
    run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))

    def other(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.all_gather(np.ones(1 << 16, np.float32))
        else:
            pg.reduce_scatter(np.ones(1 << 17, np.float32))
    errors = run_on(gs, other, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "all_gather" in str(e) and "reduce_scatter" in str(e)
               for e in errors), errors


def _die_mid_stream(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Rank 1 kills itself after a few large all-reduces; the others keep going and must raise."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp", BackendOptions(timeout=5.0, tcp=EVERY_OP))
    all_reduce_until_killed(pg, np.ones(3_000_000, np.float32), 50, 3, q, lambda pg: single_copy_of(pg) is not None)


def test_a_killed_process_makes_the_others_raise_promptly() -> None:
    items, codes = collect_from_processes(_die_mid_stream, 3, expect=2)
    check_killed_rank_1(items, codes, 3)


def _every_op() -> dict[str, Any]:
    pg = axond.distributed.default_group()
    return {**every_large_op(pg), "single_copy": single_copy_of(pg) is not None}


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_real_processes_read_each_other() -> None:
    out = run_processes(_every_op, 3, timeout=60.0, env={"AXOND_SHM_MIN_BYTES": "0"})
    check_every_large_op(out)
    assert all(got["single_copy"] for got in out)


@pytest.mark.parametrize("form", ["separate", "row of out", "strided"])
def test_all_gather_reads_each_block_from_wherever_it_is(made: list[ProcessGroup], form: str) -> None:
    """The peers read a rank's input itself (then it fills its row meanwhile), or its row of `out` where the input
    is that row (torch's all_gather_into_tensor) or not contiguous."""
    made += groups(3)
    count = 70_001

    def body(pg: ProcessGroup) -> np.ndarray:
        out = np.zeros((pg.size, count), np.float64)
        if form == "row of out":
            out[pg.rank] = np.arange(count) + 1000.0 * pg.rank
            x = out[pg.rank]
        elif form == "strided":
            x = np.repeat(np.arange(count) + 1000.0 * pg.rank, 2)[::2]  # every other element: not contiguous
            assert not x.flags.c_contiguous
        else:
            x = np.arange(count) + 1000.0 * pg.rank
        got = pg.all_gather(x, out=out)
        assert got is out
        return out

    want = np.stack([np.arange(count) + 1000.0 * r for r in range(3)])
    for got in run_on(made, body):
        np.testing.assert_array_equal(got, want)
    assert all(single_copy_of(pg) is not None for pg in made)
