"""Arrays in shared memory from the start (`axond.shared_empty`): the allocator and its registry, the peer-side
mappings, and every large op on the single-copy path reading them with plain copies (and reducing straight from
them), alone and mixed with ordinary arrays, in threads and in real processes."""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import axond
from axond import ProcessGroup, ReduceOp
from axond.distributed import BackendOptions
from axond.distributed.backends.host_copy import address
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends import shared_arrays
from axond.distributed.backends.shared_arrays import Mappings, find, shared_empty
from axond.distributed.backends.tcp.shm import single_copy
from axond.distributed.backends.tcp.policy import SINGLE_COPY_CHUNK_BYTES as CHUNK_BYTES
from axond.testing import run_on, run_processes, thread_groups

pytestmark = pytest.mark.skipif(single_copy.local_obstacle() is not None or not hasattr(os, "memfd_create"),
                                reason=f"single copy unavailable here: {single_copy.local_obstacle()}")


@pytest.fixture(autouse=True)
def young_heap() -> Iterator[None]:
    """The tests collect garbage to free arrays: what exists before a test is frozen (gc.freeze), so a collection
    scans only what the test made, cheap however large the test process's heap has grown."""
    gc.freeze()
    yield
    gc.unfreeze()


EVERY_OP = TcpOptions(shm_min_bytes=0)
PAGE_SIZE = 4096
"""Every op above the mailbox's sizes on the single-copy path."""


def _mapped(pg: ProcessGroup) -> int:
    sc = pg.backend.placement.single_copy  # type: ignore[union-attr]
    assert sc is not None
    return len(sc.mappings._maps)


def test_an_array_like_numpy_empty_in_shared_memory_freed_with_its_last_view() -> None:
    live = len(shared_arrays._segments)
    a = axond.shared_empty((3, 5), np.int32)
    assert a.shape == (3, 5) and a.dtype == np.int32 and a.flags.c_contiguous and a.flags.writeable
    assert (a == 0).all()
    a[...] = 7
    assert axond.shared_empty(10).dtype == np.float32 and axond.shared_empty(0).size == 0
    fd, token, offset = find(address(a[1]), a[1].nbytes) or (None, None, None)
    assert offset == 20 and os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:axond-shared-{token:x} (deleted)"
    assert find(address(a), 1 << 20) is None  # past its segment
    assert find(address(np.ones(8)), 8) is None  # an ordinary array
    view = a[2:]
    del a
    gc.collect()
    assert len(shared_arrays._segments) == live + 1 and (view == 7).all()  # the view keeps it
    del view
    gc.collect()
    assert len(shared_arrays._segments) == live
    assert not os.path.exists(f"/proc/self/fd/{fd}") or "axond-shared" not in os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize("shape, dtype, error", [((-1, 2), np.float32, ValueError), ((2.5,), np.float32, ValueError),
                                                 ((2,), object, TypeError)])
def test_bad_shapes_and_dtypes_are_refused(shape: Any, dtype: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="shared_empty"):
        shared_empty(shape, dtype)


def test_a_peer_maps_a_segment_only_while_its_token_names_it() -> None:
    a = shared_empty(4096, np.uint8)
    a[:] = np.arange(4096) % 251
    fd, token, _ = find(address(a), a.nbytes) or (0, 0, 0)
    maps = Mappings()
    view = maps.view(os.getpid(), fd, token, a.nbytes)
    assert view is not None and not view.flags.writeable and (view[: a.nbytes] == a).all()
    assert maps.view(os.getpid(), fd, token ^ 1, a.nbytes) is None  # the number names another array now
    assert maps.view(os.getpid(), fd, token, 1 << 30) is None  # larger than the segment
    assert maps.view(2**22 + 7, fd, token, 16) is None  # no such process
    with open(__file__, "rb") as f:  # a file that is not one of ours
        assert maps.view(os.getpid(), f.fileno(), token, 16) is None
    live = [shared_empty(16, np.uint8) for _ in range(shared_arrays.MAPPED + 3)]
    for b in live:  # bounded, the least recently used dropped
        bfd, btoken, _ = find(address(b), 16) or (0, 0, 0)
        assert maps.view(os.getpid(), bfd, btoken, 16) is not None
    assert len(maps._maps) == shared_arrays.MAPPED and (os.getpid(), fd, token) not in maps._maps


def _ops(pg: ProcessGroup, alloc: Any) -> dict[str, Any]:
    """A large all_reduce (SUM over random floats, then AVG), broadcast, all_gather (into `out`) and reduce_scatter
    (MAX) whose buffers come from `alloc(shape, dtype)`."""
    r, n = pg.rank, pg.size
    count = 2 * n * CHUNK_BYTES // 4 + 5  # several chunks per part, a ragged end
    x = alloc(count, np.float32)
    x[...] = np.random.default_rng(r).standard_normal(count).astype(np.float32)
    pg.all_reduce(x)
    avg = alloc(300_007, np.float64)
    avg[...] = np.arange(300_007) + r
    pg.all_reduce(avg, ReduceOp.AVG)
    y = alloc(300_001, np.int32)
    y[...] = np.arange(300_001) if r == 1 else r
    pg.broadcast(y, 1)
    out = alloc((n, 200_000), np.uint8)
    pg.all_gather(np.full(200_000, r, np.uint8), out=out)
    src = alloc((n * 70_001, 2), np.int64)
    src[...] = r + 1
    return {"sum": x.copy(), "avg": avg.copy(), "bcast": y.copy(), "gather": out.copy(),
            "scatter": pg.reduce_scatter(src, ReduceOp.MAX), "pid": os.getpid()}


def _check(out: list[dict[str, Any]]) -> None:
    n = len(out)
    count = 2 * n * CHUNK_BYTES // 4 + 5
    want = functools.reduce(np.add, [np.random.default_rng(r).standard_normal(count).astype(np.float32)
                                     for r in range(n)])  # in rank order: the bits of one process
    for got in out:
        assert got["sum"].tobytes() == want.tobytes()
        np.testing.assert_array_equal(got["avg"], np.arange(300_007) + (n - 1) / 2)
        np.testing.assert_array_equal(got["bcast"], np.arange(300_001, dtype=np.int32))
        assert (got["gather"] == np.arange(n, dtype=np.uint8)[:, None]).all()
        assert (got["scatter"] == n).all() and got["scatter"].shape == (70_001, 2)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("who", ["all", "rank 0"])  # every rank's buffers shared, or only rank 0's
def test_every_large_op_reads_shared_buffers_through_mappings(made: list[ProcessGroup], size: int, who: str) -> None:
    made += thread_groups(size, options=BackendOptions(timeout=10.0, tcp=EVERY_OP))

    def body(pg: ProcessGroup) -> dict[str, Any]:
        shared = who == "all" or pg.rank == 0
        got = _ops(pg, shared_empty if shared else lambda shape, dtype: np.empty(shape, dtype))
        return {**got, "mapped": _mapped(pg)}

    out = run_on(made, body, timeout=60.0)
    _check(out)
    for r, got in enumerate(out):  # each rank mapped its peers' segments (rank 0's own are only read by the others)
        assert got["mapped"] > 0 if who == "all" or r != 0 else got["mapped"] == 0, (r, got["mapped"])


def test_buffers_freed_and_allocated_again_between_ops_are_mapped_afresh(made: list[ProcessGroup]) -> None:
    """Each round frees the last round's array and allocates a new one (a memfd number may come back with another
    token): every read gets the new contents."""
    made += thread_groups(2, options=BackendOptions(timeout=10.0, tcp=EVERY_OP))

    def body(pg: ProcessGroup) -> list[float]:
        sums = []
        for i in range(6):
            x = shared_empty(100_000, np.float64)
            x[...] = pg.rank + 10 * i
            pg.all_reduce(x)
            sums.append(float(x[0]) if (x == x[0]).all() else float("nan"))
            del x
            gc.collect()
        return sums

    for sums in run_on(made, body, timeout=60.0):
        assert sums == [1.0 + 20 * i for i in range(6)]


def _every_op_shared() -> dict[str, Any]:
    pg = axond.distributed.default_group()
    return {**_ops(pg, shared_empty), "mapped": _mapped(pg)}


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_real_processes_map_each_other() -> None:
    out = run_processes(_every_op_shared, 3, timeout=90.0, env={"AXOND_SHM_MIN_BYTES": "0"})
    assert len({got["pid"] for got in out}) == 3
    _check(out)
    assert all(got["mapped"] > 0 for got in out)


def test_a_peer_drops_the_mappings_of_segments_their_owner_freed() -> None:
    maps = Mappings()
    a = shared_empty(1 << 16, np.uint8)
    fd, token, _ = find(address(a), a.nbytes) or (0, 0, 0)
    assert maps.view(os.getpid(), fd, token, a.nbytes) is not None
    del a
    gc.collect()  # freed: its memfd closed
    b = shared_empty(1 << 16, np.uint8)
    bfd, btoken, _ = find(address(b), b.nbytes) or (0, 0, 0)
    assert maps.view(os.getpid(), bfd, btoken, b.nbytes) is not None
    assert list(maps._maps) == [(os.getpid(), bfd, btoken)]


@pytest.mark.parametrize("nbytes", [5, 4096, (1 << 20) + 3, 5 << 20])
@pytest.mark.parametrize("gap", [0, 16, 2048])  # 16: the page distance `rep movsb` is slow at (memcpy instead)
def test_large_copies_copy_every_byte(nbytes: int, gap: int) -> None:
    from axond.distributed.backends.host_copy import large_copy

    src = np.random.default_rng(nbytes).integers(0, 256, nbytes + 8192, dtype=np.uint8)
    dst = np.zeros(nbytes + 8192, np.uint8)
    at = (-address(dst)) % 4096 + gap
    frm = (-address(src)) % 4096
    large_copy(dst[at : at + nbytes], src[frm : frm + nbytes])
    assert (dst[at : at + nbytes] == src[frm : frm + nbytes]).all()
    assert not dst[:at].any() and not dst[at + nbytes :].any()  # nothing past either end


def test_large_copy_without_the_compiled_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    from axond.distributed.backends import host_copy

    src = np.arange(3 << 18, dtype=np.float32)  # 3 MiB
    dst = np.zeros_like(src)
    monkeypatch.setattr(host_copy, "_MOVSB", None)  # an install without a C compiler
    host_copy.large_copy(dst, src)
    assert (dst == src).all()


def test_large_copy_and_its_helper_refuse_bad_arguments() -> None:
    from axond.distributed.backends import host_copy

    if host_copy._MOVSB is None:
        pytest.skip("the install built no _hostcopy helper (no C compiler)")
    src, dst = np.ones(3 << 20, np.uint8), np.zeros(2 << 20, np.uint8)
    with pytest.raises(ValueError, match="large_copy: 3145728 bytes into 2097152"):
        host_copy.large_copy(dst, src)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        host_copy._MOVSB(address(dst), address(src), -1)
    with pytest.raises(TypeError, match="takes 3 integers"):
        host_copy._MOVSB(address(dst), address(src))
    assert not dst.any()


def test_a_segment_at_the_address_of_one_freed_but_not_yet_released_stays_registered() -> None:
    """The address of a freed segment may be mapped again (in another thread) before its release runs: the
    release of the old one must leave the new one's entry."""
    start = 1 << 46  # an address no segment of this process has
    with shared_arrays._lock:
        shared_arrays._starts.append(start)
        shared_arrays._segments[start] = (start + PAGE_SIZE, 10**6, 1)  # the old segment, memfd 10**6
        shared_arrays._segments[start] = (start + PAGE_SIZE, 10**6 + 1, 2)  # a new one took its address
    try:
        with pytest.raises(OSError):
            shared_arrays._release(start, 10**6)  # the old one's release: its (fake) memfd cannot be closed
        assert find(start, 8) == (10**6 + 1, 2, 0)
    finally:
        with shared_arrays._lock:
            del shared_arrays._segments[start]
            shared_arrays._starts.remove(start)
