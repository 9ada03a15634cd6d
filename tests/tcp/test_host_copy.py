"""Copies that step around AMD's slow `rep movsb` distance: the same bytes on every branch, the arena's slots placed
where glibc's mmap'd arrays start, and the single-copy reader's bounce buffer."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from axond.distributed.backends import host_copy
from axond.distributed.backends.host_copy import PAGE, address, copy, copy_changed, slow_distance
from axond.distributed.backends.tcp.shm import arena as arena_mod
from axond.distributed.backends.tcp.shm import single_copy

pytestmark = pytest.mark.timeout(60)


def past(nbytes: int, distance: int) -> int:
    """An offset past `nbytes` from 0, `distance` bytes into a page."""
    return -(-nbytes // PAGE) * PAGE + PAGE + distance


def at(pool: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of `pool` starting `offset` bytes past its first page boundary."""
    start = (-address(pool)) % PAGE + offset
    return pool[start : start + nbytes]


def test_address_is_the_data_pointer() -> None:
    a = np.arange(100, dtype=np.float64)
    for view in (a, a[3:], a[::2], a.reshape(10, 10)[4]):
        assert address(view) == view.__array_interface__["data"][0]


@pytest.mark.parametrize("distance, slow", [(0, False), (1, True), (16, True), (31, True), (32, False),
                                            (PAGE - 16, False), (PAGE + 16, True)])
def test_slow_distance(distance: int, slow: bool) -> None:
    assert slow_distance(10 * PAGE + 48 + distance, 10 * PAGE + 48) is slow


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.float64, np.int16])
@pytest.mark.parametrize("nbytes", [64, 8192, 65536, 300_000, 1 << 20])
@pytest.mark.parametrize("distance", [16, 24, 2048, 0])
def test_copy_1d_is_exact_at_every_distance(dtype: type, nbytes: int, distance: int) -> None:
    pool = np.zeros(4 * nbytes + 4 * PAGE, np.uint8)
    src = at(pool, 0, nbytes).view(dtype)
    dst = at(pool, past(nbytes, distance), nbytes).view(dtype)
    bits = np.random.default_rng(nbytes + distance).integers(0, 256, nbytes, dtype=np.uint8)
    src.view(np.uint8)[...] = bits  # any bits, NaN payloads included: the copy is of bytes
    assert (address(dst) - address(src)) % PAGE == distance
    copy(dst, src)
    assert np.array_equal(dst.view(np.uint8), bits)


def test_copy_2d_rows_at_different_distances() -> None:
    """Rows from differently strided slots: each row looked at alone (some slow, some not), all bytes right."""
    rows, width = 3, 65536
    pool = np.zeros(16 * width, np.uint8)
    src = at(pool, 0, rows * (width + PAGE)).reshape(rows, width + PAGE)[:, :width]
    dst = at(pool, 8 * width + 16, rows * (width + 8)).reshape(rows, width + 8)[:, :width]
    distances = [(address(dst[k]) - address(src[k])) % PAGE for k in range(rows)]
    assert any(slow_distance(address(dst[k]), address(src[k])) for k in range(rows))
    assert not all(slow_distance(address(dst[k]), address(src[k])) for k in range(rows)), distances
    src[...] = np.random.default_rng(1).integers(0, 256, src.shape, dtype=np.uint8)
    copy(dst, src)
    assert np.array_equal(dst, src)


def test_copy_falls_back_for_other_layouts() -> None:
    a = np.arange(40000, dtype=np.float32)
    out = np.zeros(20000, np.float32)
    copy(out, a[::2])  # strided source
    assert np.array_equal(out, a[::2])
    cube = np.arange(3 * 40 * 50, dtype=np.float64).reshape(3, 40, 50)
    dest = np.zeros_like(cube)
    copy(dest, cube)
    assert np.array_equal(dest, cube)


def test_data_arena_slots_start_where_mmapped_arrays_do() -> None:
    if not arena_mod.available():
        pytest.skip("no writable /dev/shm")
    big = at(np.ones(5 << 20, np.uint8), 16, 4 << 20)  # as malloc lays out what it maps: 16 bytes into a page
    arena = arena_mod.ShmArena.create(2, 8 << 20, arena_mod.SLOT_SHIFT)
    plain = arena_mod.ShmArena.create(2, 8 << 20)
    try:
        for buf in (0, 1):
            slots = arena.slots(buf, np.dtype(np.float32), 1000)
            for k in range(2):
                assert address(slots[k]) % PAGE == arena_mod.SLOT_SHIFT
                assert not slow_distance(address(big), address(slots[k]))
                assert not slow_distance(address(slots[k]), address(big))
            assert address(arena.result(buf, np.dtype(np.uint8), 10)) % PAGE == arena_mod.SLOT_SHIFT
        assert address(plain.slots(0, np.dtype(np.uint8), 8)[0]) % PAGE == 0
        # every slot holds `chunk` bytes of its own
        whole = arena.slots(0, np.dtype(np.uint8), arena.chunk)
        whole[0] = 1
        whole[1] = 2
        assert (whole[0] == 1).all() and (arena.result(0, np.dtype(np.uint8), arena.chunk) == 0).all()
        other = arena_mod.ShmArena(arena.path, 2, arena.chunk, create=False, shift=arena_mod.SLOT_SHIFT)
        try:
            assert (other.slots(0, np.dtype(np.uint8), arena.chunk)[1] == 2).all()
        finally:
            other.close()
    finally:
        for a in (arena, plain):
            arena_mod.unlink(a.path)
            a.close()


@pytest.mark.skipif(not sys.platform.startswith("linux") or single_copy.local_obstacle() is not None,
                    reason="process_vm_readv is not usable here")
@pytest.mark.parametrize("nbytes", [PAGE + 8, 300_000, (5 << 20) // 2])
@pytest.mark.parametrize("distance", [16, 8, 2048])
def test_single_copy_read_at_a_slow_distance_goes_through_the_bounce_buffer(nbytes: int, distance: int) -> None:
    pool = np.zeros(2 * nbytes + 4 * PAGE, np.uint8)
    src = at(pool, 0, nbytes)
    dst = at(pool, past(nbytes, distance), nbytes)
    assert (address(dst) - address(src)) % PAGE == distance
    src[...] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    reader = single_copy.Reader()
    reader.read(os.getpid(), address(src), dst)
    assert np.array_equal(dst, src)
    bounced = slow_distance(address(dst), address(src)) and nbytes >= single_copy.BOUNCE_MIN_BYTES
    assert (reader._bounce is not None) is bounced



@pytest.mark.parametrize("nbytes", [100, 4096, 3 * 4096 + 5, 1 << 20])
def test_copy_changed_skips_the_blocks_it_holds_up_to_the_first_that_differs(nbytes: int) -> None:
    pool = np.zeros(4 * nbytes + 4 * PAGE, np.uint8)
    src = at(pool, 0, nbytes)
    dst = at(pool, past(nbytes, 2048), nbytes)  # not at a slow distance (malloc's arrays may be)
    src[...] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert copy_changed(dst, src) == nbytes and np.array_equal(dst, src)
    assert copy_changed(dst, src) == 0 and np.array_equal(dst, src)  # unchanged: nothing written
    for where in (nbytes - 1, nbytes // 2, 0):
        src[where] ^= 0xFF
        first = where // 4096 * 4096
        assert copy_changed(dst, src) == nbytes - first, where
        assert np.array_equal(dst, src)


def test_copy_changed_falls_back_to_a_plain_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the compiled helper, at a slow distance and for other layouts: every byte written, all right."""
    nbytes = 1 << 16
    pool = np.zeros(4 * nbytes + 4 * PAGE, np.uint8)
    src = at(pool, 0, nbytes)
    dst = at(pool, past(nbytes, 16), nbytes)
    src[...] = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    assert slow_distance(address(dst), address(src))
    assert copy_changed(dst, src) == nbytes and np.array_equal(dst, src)
    a = np.arange(40000, dtype=np.float32)
    out = np.zeros(20000, np.float32)
    assert copy_changed(out, a[::2]) == out.nbytes and np.array_equal(out, a[::2])
    monkeypatch.setattr(host_copy, "_CHANGED", None)
    b = np.arange(5000, dtype=np.float64)
    dest = b.copy()
    assert copy_changed(dest, b) == b.nbytes  # no helper to tell what it holds


@pytest.mark.skipif(host_copy._CHANGED is None, reason="the compiled helper was not built")
def test_the_compiled_copy_changed_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="takes 3 integers"):
        host_copy._CHANGED(0, 0)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        host_copy._CHANGED(0, 0, -1)
    assert host_copy._CHANGED(0, 0, 0) == 0


@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 64, 65, 4 * PAGE - 1, 4 * PAGE, 16 * PAGE + 77, (1 << 20) + 13])
@pytest.mark.parametrize("dst_offset, src_offset", [(0, 0), (1, 0), (15, 33), (8, 7)])
def test_stream_copy_writes_exactly_the_bytes_at_any_alignment(nbytes: int, dst_offset: int, src_offset: int) -> None:
    """Every byte of the source lands, none around the destination is touched: the head before a 16-byte boundary,
    the four-page blocks, the lines after them and the tail."""
    rng = np.random.default_rng(nbytes + dst_offset)
    pool = np.zeros(nbytes + 3 * PAGE, np.uint8)
    source = rng.integers(0, 256, nbytes + 2 * PAGE, dtype=np.uint8)
    dst = at(pool, dst_offset, nbytes)
    src = at(source, src_offset, nbytes)
    host_copy.stream_copy(dst, src)
    assert np.array_equal(dst, src)
    start = (-address(pool)) % PAGE + dst_offset
    assert not pool[:start].any() and not pool[start + nbytes :].any()


def test_stream_copy_falls_back_for_casts_strides_and_no_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    a = np.arange(3000, dtype=np.float32)
    out = np.zeros(1500, np.float32)
    host_copy.stream_copy(out, a[::2])
    assert np.array_equal(out, a[::2])
    wide = np.zeros(3000, np.float64)
    host_copy.stream_copy(wide, a)  # a cast, as np.copyto
    assert np.array_equal(wide, a)
    monkeypatch.setattr(host_copy, "_STREAM", None)
    plain = np.zeros(3000, np.float32)
    host_copy.stream_copy(plain, a)
    assert np.array_equal(plain, a)


@pytest.mark.skipif(host_copy._STREAM is None, reason="the compiled helper was not built")
def test_the_compiled_stream_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="takes 3 integers"):
        host_copy._STREAM(0, 0)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        host_copy._STREAM(0, 0, -1)
    host_copy._STREAM(0, 0, 0)


def test_a_helper_built_from_an_older_source_leaves_the_missing_function_to_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worktree whose compiled helper predates `stream` (not rebuilt after an update) still imports; the copy then
    takes the Python path."""
    _hostcopy = pytest.importorskip("axond.distributed.backends._hostcopy")
    monkeypatch.delattr(_hostcopy, "stream", raising=False)
    assert host_copy._compiled("stream") is None
