"""The single-copy path in its compiled form (`_fastbox.SC_BROADCAST`, `SC_ALL_GATHER`): the sizes that take it only
where every member runs the compiled ops (`policy.needs_compiled`), ahead of the mailbox or the arena. Real ranks (threads of this
process, and processes), the same bytes as one process; the two-rank broadcast's split (the root writes the second
part of the member's buffer while the member reads the first), reads and writes at a slow distance (the bounce
buffer), a member without the compiled ops, a mismatched call, a killed peer."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import (ORDERED_STORES, Path, Shape, compiled_single_copy, needs_compiled,
                                                   route)
from axond.distributed.backends.tcp.shm import mailbox, single_copy
from axond.distributed.backends.tcp.shm.single_copy_ops import PreparedAllGather, PreparedBroadcast
from axond.distributed.backends.tcp.transport.wire import Op
from axond.testing import collect_from_processes, run_on, thread_groups

KiB = 1 << 10

needs_it = pytest.mark.skipif(
    mailbox._fastbox is None or not ORDERED_STORES or single_copy.local_obstacle() is not None,
    reason="the compiled single copy needs the compiled helper, x86 and process_vm_readv "
           f"({single_copy.local_obstacle() or 'no compiled helper or not x86'})")


def test_the_policy_sends_the_measured_sizes_there_and_only_with_the_defaults() -> None:
    two, four = Shape(2), Shape(4, oversubscribed=True)
    assert route(Op.ALL_GATHER, 256 * KiB, two).path is Path.MAILBOX  # 512 KiB of output
    assert route(Op.ALL_GATHER, 1 << 20, two).path is Path.ARENA  # 2 MiB
    assert route(Op.ALL_GATHER, 2 << 20, two).path is Path.SINGLE_COPY  # 4 MiB
    assert route(Op.ALL_GATHER, 64 * KiB, four).path is Path.MAILBOX
    assert route(Op.ALL_GATHER, 384 * KiB, four).path is Path.ARENA  # 1.5 MiB
    assert route(Op.ALL_GATHER, 512 * KiB, four).path is Path.SINGLE_COPY  # 2 MiB
    assert route(Op.BROADCAST, 64 * KiB, two).path is Path.MAILBOX  # one copy loses where the input was just written
    assert route(Op.BROADCAST, 4 << 20, two).path is Path.ARENA
    assert route(Op.BROADCAST, 8 << 20, two).path is Path.SINGLE_COPY
    assert route(Op.BROADCAST, 1 << 20, four).path is Path.MAILBOX  # in chunks of a slot
    assert route(Op.BROADCAST, 8 << 20, four).path is Path.ARENA
    assert route(Op.ALL_REDUCE, 128 * KiB, two).path is Path.MAILBOX
    for options in (TcpOptions(shm_native=False), TcpOptions(shm_single_copy=False), TcpOptions(shm_mailbox=False),
                    TcpOptions(shm_min_bytes=8 << 20)):
        assert route(Op.ALL_GATHER, 2 << 20, two, options).path is not Path.SINGLE_COPY, options
    assert route(Op.ALL_GATHER, 2 << 20, Shape(2, ordered_stores=False)).path is not Path.SINGLE_COPY
    assert route(Op.ALL_GATHER, 1 << 20, Shape(4, hosts=2, per_host=2)).path is not Path.SINGLE_COPY


def test_a_group_without_the_compiled_ops_keeps_the_python_single_copy_where_it_always_took_it() -> None:
    two = Shape(2)
    assert compiled_single_copy(Op.BROADCAST, 64 << 20, two, TcpOptions())
    assert not needs_compiled(Op.BROADCAST, 64 << 20, two, TcpOptions())  # the Python path takes it too
    assert needs_compiled(Op.BROADCAST, 8 << 20, two, TcpOptions())
    assert route(Op.BROADCAST, 64 << 20, two, TcpOptions(shm_native=False)).path is Path.SINGLE_COPY
    assert route(Op.BROADCAST, 8 << 20, two, TcpOptions(shm_native=False)).path is Path.ARENA


def _placed(raw: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of `raw` starting at `offset` bytes into a page."""
    start = (offset - raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def _prepared(pg: ProcessGroup) -> list[Any]:
    return [r.form for r in pg.fast_path.runners().values()]  # type: ignore[attr-defined]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@needs_it
def test_broadcast_from_every_root_gives_the_roots_bytes_prepared_in_one_c_call(made: list[ProcessGroup]) -> None:
    size = 2
    made += thread_groups(size, timeout=10.0)
    nbytes = (8 << 20) + 3  # an odd size, inside the window

    def body(pg: ProcessGroup) -> list[bytes]:
        x = np.empty(nbytes, np.uint8)
        got = []
        for i in range(2 * size):
            root = i % size
            x[...] = np.arange(nbytes) * (pg.rank + 1) + i if pg.rank == root else 7
            box = pg.backend.placement.mailbox  # type: ignore[union-attr]
            ops = box.ops if box is not None else 0
            pg.broadcast(x, root)
            if i >= size:  # prepared by its first call from this root: publications and the last post, in C
                assert pg.backend.placement.mailbox.ops == ops + 2  # type: ignore[union-attr]
            got.append(x.tobytes())
        return got

    for got in run_on(made, body, timeout=60.0):
        for i, data in enumerate(got):
            want = (np.arange(nbytes) * (i % size + 1) + i).astype(np.uint8)
            assert data == want.tobytes(), i
    for pg in made:
        sc = pg.backend.placement.single_copy  # type: ignore[union-attr]
        assert sc is not None and sc.compiled
        assert sum(isinstance(p, PreparedBroadcast) and p.native is not None for p in _prepared(pg)) == size


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@needs_it
@pytest.mark.parametrize("distance", [0, 8, 16, 2048])
def test_the_split_broadcast_and_its_bounces_at_every_distance(made: list[ProcessGroup], distance: int) -> None:
    """Two ranks: the member reads the first part, the root writes the second; buffers `distance` bytes apart modulo
    the page (8 and 16: the kernel's slow string copy, through the bounce buffer both ways, in several rounds)."""
    made += thread_groups(2, timeout=10.0)
    nbytes = (8 << 20) + 40
    raws = [np.zeros(nbytes + 8192, np.uint8) for _ in range(2)]

    def body(pg: ProcessGroup) -> list[bytes]:
        x = _placed(raws[pg.rank], 256 + distance * pg.rank, nbytes)
        got = []
        for i in range(4):
            x[...] = (np.arange(nbytes) + 3 * i) % 251 if pg.rank == 0 else 0
            pg.broadcast(x, 0)
            got.append(x.tobytes())
        return got

    got = run_on(made, body, timeout=60.0)
    for i in range(4):
        want = ((np.arange(nbytes) + 3 * i) % 251).astype(np.uint8).tobytes()
        assert got[0][i] == want and got[1][i] == want, i


@needs_it
@pytest.mark.parametrize("size,count", [(2, 300_001), (4, 70_001)])  # output 4.6, 2.1 MiB
@pytest.mark.parametrize("form", ["separate", "row of out", "inside out", "strided", "strided on rank 0"])
def test_all_gather_in_every_form_gives_every_block(made: list[ProcessGroup], form: str, size: int,
                                                    count: int) -> None:
    """The input apart from the output, its own row, another row, not contiguous (the Python path on every rank), and
    not contiguous on rank 0 alone: rank 0 on the Python path, the others in C, in the same ops."""
    made += thread_groups(size, timeout=10.0)

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        got = []
        for i in range(4):
            out = np.zeros((size, count), np.float64)
            block = np.arange(count) + 1000.0 * pg.rank + i
            if form == "row of out":
                out[pg.rank] = block
                x = out[pg.rank]
            elif form == "inside out":  # a view of another row: copied into its own row first
                out[(pg.rank + 1) % size] = block
                x = out[(pg.rank + 1) % size]
            elif form == "strided" or (form == "strided on rank 0" and pg.rank == 0):
                x = np.repeat(block, 2)[::2]  # not for the C call: this rank runs the op on the Python path
            else:
                x = block
            assert pg.all_gather(x, out=out) is out
            got.append(out)
        return got

    for got in run_on(made, body, timeout=60.0):
        for i, out in enumerate(got):
            np.testing.assert_array_equal(out, np.stack([np.arange(count) + 1000.0 * r + i for r in range(size)]))
    assert all(any(isinstance(p, PreparedAllGather) for p in _prepared(pg)) for pg in made)


@needs_it
def test_a_member_without_the_compiled_ops_keeps_the_group_on_the_arena(made: list[ProcessGroup]) -> None:
    """The members differ in `shm_native`: both still set the single-copy path up at the same op (the all_gather
    below, which only the compiled member could run there), agree it is not compiled, and take the arena."""
    made += thread_groups(2, options=[BackendOptions(timeout=10.0, tcp=TcpOptions(shm_native=n)) for n in (True, False)])

    def body(pg: ProcessGroup) -> bytes:
        x = np.full(2 << 20, pg.rank + 1, np.uint8)  # 4 MiB of output
        for _ in range(3):
            out = pg.all_gather(x)
        return bytes(out.tobytes())

    assert run_on(made, body) == [bytes([1]) * (2 << 20) + bytes([2]) * (2 << 20)] * 2
    for pg in made:
        sc = pg.backend.placement.single_copy  # type: ignore[union-attr]
        assert sc is not None and not sc.compiled
        assert not any(isinstance(p, PreparedAllGather) for p in _prepared(pg))
        assert pg.backend.placement.arena is not None  # type: ignore[union-attr]  # the arena's, on both


@needs_it
def test_a_mismatched_call_raises_on_every_rank_naming_both(made: list[ProcessGroup]) -> None:
    made += thread_groups(2, timeout=5.0)
    x = [np.zeros(8 << 20, np.uint8) for _ in range(2)]
    run_on(made, lambda pg: [pg.broadcast(x[pg.rank], 0) for _ in range(3)])  # prepared

    def body(pg: ProcessGroup) -> None:
        pg.broadcast(x[pg.rank], pg.rank)  # each its own root

    errors = run_on(made, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "broadcast" in str(e) for e in errors), errors
    assert all("broadcast src=0" in str(e) and "broadcast src=1" in str(e) for e in errors), errors


def _killed_mid_all_gathers(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Rank 1 SIGKILLs itself after a few prepared all_gathers of 4 MiB of output; the others must raise."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp", BackendOptions(timeout=5.0))
    x = np.zeros(2 << 20, np.uint8)
    t0 = time.monotonic()
    try:
        for i in range(200):
            if rank == 1 and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            pg.all_gather(x)
            t0 = time.monotonic()
        q.put((rank, "no error", 0.0))
    except DistributedError as e:
        q.put((rank, str(e), time.monotonic() - t0))
    pg.destroy()


@needs_it
def test_a_killed_member_makes_the_other_raise_promptly() -> None:
    items, codes = collect_from_processes(_killed_mid_all_gathers, 2, expect=1)
    (rank, msg, took), = items
    assert rank == 0 and "rank 1" in msg and "all_gather" in msg, msg
    assert took < 2.0
    assert codes[1] == -signal.SIGKILL
