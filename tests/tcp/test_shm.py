"""The tcp backend's shared-memory path between ranks on one host: when it is taken, that every member agrees
on it (or none uses it), rank-order numbers, buffer reuse across steps and ops, failures, and no files left.

Every collective also runs through it in test_collectives (transport "shm") and the random programs.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import glob
import os
import time
from typing import Any

import numpy as np
import pytest

import axond
from axond import DistributedError, ProcessGroup
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions, policy
from axond.distributed.backends.tcp.policy import (AUTO_MIN_BYTES, MAILBOX_SYNC_MIN_BYTES, ORDERED_STORES,
                                                   PAIR_BROADCAST_STEP_MIN_BYTES, STEP_BYTES, arena_step,
                                                   mailbox_limit)
from axond.distributed.backends.tcp.transport.wire import Op
from axond.distributed.backends.tcp.shm.arena import ShmArena, chunk_bytes
from axond.distributed.backends.host_copy import copy_changed
from axond.distributed.backends.tcp.shm import arena_ops
from axond.distributed.backends.tcp.shm.arena_ops import _copy_laid
from axond.testing import collect_from_processes, run_on, run_processes, thread_groups
from collective_cases import (all_reduce_until_killed, check_every_large_op, check_killed_rank_1,
                              check_other_call_raises, every_large_op)

MakeGroups = Any


@pytest.fixture(autouse=True)
def arena_not_single_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large ops here take the arena, as where the single-copy path is unavailable (tests/tcp/test_single_copy.py)."""
    monkeypatch.setenv("AXOND_SHM_SINGLE_COPY", "0")


def arena_of(pg: ProcessGroup) -> Any:
    return pg.backend.placement.arena  # type: ignore[union-attr]


def leftovers() -> list[str]:
    """Arena files created by this process (rank 0 of thread groups) still in /dev/shm."""
    return glob.glob(f"/dev/shm/axond-{os.getpid()}-*")


def least_bytes(crowded: bool, mailbox: bool) -> int:
    """The auto threshold: lower where the arena's steps synchronize through the mailbox (x86, mailbox on)."""
    return MAILBOX_SYNC_MIN_BYTES if mailbox and ORDERED_STORES else AUTO_MIN_BYTES[crowded]


@pytest.mark.parametrize("mailbox", [True, False])
def test_small_ops_stay_on_sockets_and_large_ones_set_the_arena_up_once(monkeypatch: pytest.MonkeyPatch,
                                                                        make_groups: MakeGroups, mailbox: bool) -> None:
    monkeypatch.setenv("AXOND_SHM_MAILBOX", "1" if mailbox else "0")
    gs = make_groups(2, 10.0)
    assert not any(pg.backend.comm.oversubscribed for pg in gs)  # type: ignore[union-attr]  # 2 threads, 2+ cores
    least = least_bytes(False, mailbox)
    if mailbox and ORDERED_STORES:
        least = max(least, mailbox_limit(Op.ALL_REDUCE, 2))  # what the mailbox takes (64 KiB) stays off the arena
    run_on(gs, lambda pg: pg.all_reduce(np.ones((least - 8) // 8)))
    assert all(arena_of(pg) is None and not pg.backend.placement.arena_tried for pg in gs)  # type: ignore[union-attr]
    out = run_on(gs, lambda pg: pg.all_reduce(np.full(least // 8 + 1, pg.rank + 1.0)) or pg)
    arenas = [arena_of(pg) for pg in out]
    assert all(a is not None for a in arenas) and len({a.path for a in arenas}) == 1
    run_on(gs, lambda pg: pg.all_gather(np.ones(1 << 16)))
    assert [arena_of(pg) for pg in gs] == arenas  # set up once per group
    assert leftovers() == []  # unlinked once every member mapped it


@pytest.mark.parametrize("mailbox", [True, False])
def test_crowded_hosts_broadcast_and_multi_rank_all_reduce_need_larger_ops(monkeypatch: pytest.MonkeyPatch,
                                                                           make_groups: MakeGroups,
                                                                           mailbox: bool) -> None:
    """Broadcast: 2 times the threshold, or 16 on a crowded host whose arena steps spin (the socket tree's root need
    not wait); all_reduce on more than two ranks: 2 times (two synchronizations per step)."""
    monkeypatch.setenv("AXOND_SHM_MAILBOX", "1" if mailbox else "0")
    gs = make_groups(3, 10.0, crowded=True)
    least = least_bytes(True, mailbox)
    broadcast = 16 if mailbox and ORDERED_STORES else 2
    run_on(gs, lambda pg: pg.all_gather(np.ones(least // 3 // 8 - 1)))
    run_on(gs, lambda pg: pg.broadcast(np.ones(broadcast * least // 8 - 1), 0))
    reduced = 2 * least
    if mailbox and ORDERED_STORES:
        reduced = max(reduced, mailbox_limit(Op.ALL_REDUCE, 3) + 8)  # the mailbox takes all_reduce up to its slot size
    run_on(gs, lambda pg: pg.all_reduce(np.ones(reduced // 8 - 1)))
    assert all(arena_of(pg) is None and not pg.backend.placement.arena_tried for pg in gs)  # type: ignore[union-attr]
    run_on(gs, lambda pg: pg.all_reduce(np.ones(reduced // 8)))
    assert all(arena_of(pg) is not None for pg in gs)
    assert all((pg.backend.placement.mailbox is not None) == (mailbox and ORDERED_STORES) for pg in gs)  # type: ignore[union-attr]


def test_axond_shm_0_keeps_every_op_on_sockets(monkeypatch: pytest.MonkeyPatch, make_groups: MakeGroups) -> None:
    monkeypatch.setenv("AXOND_SHM", "0")
    gs = make_groups(2, 10.0)
    out = run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 20)) or pg.all_gather(np.ones(1 << 20)))
    assert all(arena_of(pg) is None for pg in gs) and out[0].shape == (2, 1 << 20)


@pytest.mark.parametrize("setting, message", [("AXOND_SHM=maybe", "AXOND_SHM='maybe'"),
                                              ("AXOND_SHM_MIN_BYTES=lots", "bad AXOND_SHM_"),
                                              ("AXOND_SHM_ARENA_BYTES=-1", "must not be negative")])
def test_bad_settings_say_what_to_set(monkeypatch: pytest.MonkeyPatch, setting: str, message: str) -> None:
    name, value = setting.split("=")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        TcpOptions.from_env()


def test_slots_are_aligned_and_bounded() -> None:
    assert chunk_bytes(32 << 20, 2) == 4 << 20 and chunk_bytes(32 << 20, 4) == (32 << 20) // 10 // 64 * 64
    assert chunk_bytes(0, 8) == 64


def test_a_laid_out_copy_skips_the_own_row_where_it_is_one_block() -> None:
    """reduce_scatter's laid-out copy (two levels) leaves row `own` to be read in place where its columns lie in one
    block, and copies it like the others where they straddle two."""
    blocks = np.arange(4 * 10, dtype=np.int64).reshape(4, 10)
    order = np.array([2, 0, 3, 1])  # row 0: blocks 2, 0; row 1: blocks 3, 1
    laid = blocks[order].reshape(2, 20)
    dst = np.full((2, 4), -1, np.int64)
    own = _copy_laid(dst, blocks, order, 3, 1)  # columns 3..7 of row 1: all in block 3
    assert np.shares_memory(own, blocks) and (own == laid[1, 3:7]).all()
    assert (dst[0] == laid[0, 3:7]).all() and (dst[1] == -1).all()
    own = _copy_laid(dst, blocks, order, 8, 0)  # columns 8..12: blocks 2 and 0
    assert not np.shares_memory(own, blocks) and (own == laid[0, 8:12]).all() and (dst == laid[:, 8:12]).all()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sums_are_those_of_one_process_adding_in_rank_order(make_groups: MakeGroups, size: int) -> None:
    """Random floats over many small-arena steps: every rank gets exactly ((x0 + x1) + x2) + ..., the parity
    of a single process (the socket algorithms add in another order, so they agree only to rounding)."""
    gs = make_groups(size, 10.0, transport="shm")
    inputs = [np.random.default_rng(r).standard_normal(100_003).astype(np.float32) for r in range(size)]
    want = functools.reduce(np.add, inputs)

    def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray]:
        x = inputs[pg.rank].copy()
        pg.all_reduce(x)
        blocks = np.concatenate([inputs[pg.rank]] * size)
        return x, pg.reduce_scatter(blocks)

    for got, block in run_on(gs, body):
        assert got.tobytes() == want.tobytes()
        assert block.tobytes() == functools.reduce(np.add, [inputs[r] for r in range(size)]).tobytes()
    assert all(arena_of(pg).chunk < 100_003 * 4 // 8 for pg in gs)  # many steps per op


def test_a_pair_steps_its_all_reduce_and_large_broadcast_a_mebibyte_at_a_time(make_groups: MakeGroups) -> None:
    """Two ranks: all_reduce, and broadcast from 4 MiB, move STEP_BYTES per arena step, not a whole slot (the
    buffers alternate per step, so the arena's turn tells the count); the sums keep rank order."""
    gs = make_groups(2, 20.0)
    count = (3 * STEP_BYTES // 2) // 4 + 3  # two steps of float32; one 4 MiB slot would hold it all
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(2)]
    size = 5 * STEP_BYTES - 8  # five steps; two slots
    assert arena_step(Op.BROADCAST, size, 2) == STEP_BYTES and arena_step(Op.BROADCAST, size, 3) == 0
    assert arena_step(Op.BROADCAST, PAIR_BROADCAST_STEP_MIN_BYTES - 8, 2) == 0

    def body(pg: ProcessGroup) -> tuple[np.ndarray, int, np.ndarray, int]:
        x = inputs[pg.rank].copy()
        pg.all_reduce(x)
        after_reduce = arena_of(pg).turn
        b = np.arange(size, dtype=np.uint8) if pg.rank == 1 else np.zeros(size, np.uint8)
        pg.broadcast(b, 1)
        return x, after_reduce, b, arena_of(pg).turn

    want = inputs[0] + inputs[1]
    for x, after_reduce, b, after_broadcast in run_on(gs, body):
        assert x.tobytes() == want.tobytes()
        assert arena_of(gs[0]).chunk == 4 << 20
        assert (after_reduce, after_broadcast) == (0, 1)  # 2 steps, then 5 (whole slots: 1, then 2)
        assert (b == np.arange(size, dtype=np.uint8)).all()


def test_more_ranks_step_their_all_reduce_a_mebibyte_at_a_time(make_groups: MakeGroups) -> None:
    """Four ranks: all_reduce moves STEP_BYTES per arena step, though a slot would hold 3.2 MiB (each step flips the
    arena's turn: 2 MiB takes two steps and leaves it as it was, 3 MiB three and flips it, where whole slots would
    flip it for both); the sums keep rank order. Other ops keep whole slots."""
    gs = make_groups(4, 20.0)
    assert arena_step(Op.ALL_REDUCE, 8 << 20, 4) == STEP_BYTES and arena_step(Op.REDUCE_SCATTER, 8 << 20, 4) == 0
    run_on(gs, lambda pg: pg.all_reduce(np.ones(STEP_BYTES // 4, np.float32)))  # the arena is up (one step)
    assert all(arena_of(pg).chunk > 3 * STEP_BYTES for pg in gs)
    inputs = {k: [np.random.default_rng(r).standard_normal(k * STEP_BYTES // 4).astype(np.float32) for r in range(4)]
              for k in (2, 3)}

    def body(pg: ProcessGroup) -> list[tuple[np.ndarray, int]]:
        out = []
        for k in (2, 3):
            x = inputs[k][pg.rank].copy()
            turn = arena_of(pg).turn
            pg.all_reduce(x)
            out.append((x, arena_of(pg).turn ^ turn))
        return out

    for got in run_on(gs, body):
        for k, (x, flipped) in zip((2, 3), got):
            a = inputs[k]
            assert x.tobytes() == (((a[0] + a[1]) + a[2]) + a[3]).tobytes()
            assert flipped == k % 2, (k, flipped)


def test_a_broadcasts_root_writes_only_what_its_slot_lacks(monkeypatch: pytest.MonkeyPatch,
                                                          make_groups: MakeGroups) -> None:
    """Three ranks broadcast through the arena: the root's copy into its slot skips the 4 KiB blocks the slot already
    holds up to the first that differs (the buffers alternate, so the third call finds the first call's bytes), and
    every rank gets the root's bits each time: unchanged, changed in one block, changed in the last byte, all new."""
    written: list[int] = []

    def spy(dst: np.ndarray, src: np.ndarray) -> int:
        n = copy_changed(dst, src)
        written.append(n)
        return n

    monkeypatch.setattr(arena_ops, "copy_changed", spy)
    monkeypatch.setattr(policy, "MAILBOX_BROADCAST_SLOTS", 1)  # past one slot: the arena, not the mailbox's chunks
    gs = make_groups(3, 20.0)
    size = 600_000
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, size, dtype=np.uint8)
    changed = base.copy()
    changed[300_000] ^= 0xFF
    last = base.copy()
    last[-1] ^= 0xFF
    calls = [base, base, base, changed, last, rng.integers(0, 256, size, dtype=np.uint8)]

    def body(pg: ProcessGroup) -> list[bytes]:
        got = []
        for data in calls:
            b = data.copy() if pg.rank == 1 else np.zeros(size, np.uint8)
            pg.broadcast(b, 1)
            got.append(b.tobytes())
        return got

    for got in run_on(gs, body):
        assert got == [data.tobytes() for data in calls]
    assert all(arena_of(pg).chunk >= size for pg in gs)  # one step per call: one copy into the root's slot
    block = 300_000 // 4096 * 4096
    # calls 3-5 find calls 1-3's bytes (base) in their buffer's slot; the last finds call 4's
    assert written[2:] == [0, size - block, size - (size - 1) // 4096 * 4096, size], written


@pytest.mark.parametrize("size", [2, 3, 4])
def test_back_to_back_ops_and_async_queues_never_overwrite_what_a_peer_reads(make_groups: MakeGroups,
                                                                             size: int) -> None:
    """Ops of different kinds and sizes, blocking and queued, each spanning an odd number of steps, so that the
    alternating buffers meet every pairing of (op, step parity); a rank sleeps at times to let the others run ahead."""
    gs = make_groups(size, 20.0, transport="shm")
    rounds = 6

    def body(pg: ProcessGroup) -> list[Any]:
        r, n = pg.rank, pg.size
        rng = np.random.default_rng(r)
        got: list[Any] = []
        for i in range(rounds):
            if rng.random() < 0.3:
                time.sleep(0.01)
            a = np.full(9_001 + 1000 * i, r + i, np.int64)
            works = [pg.all_reduce(a, async_op=True)]
            b = np.full(5_003 + i, r * 10 + i, np.int32)
            gathered = pg.all_gather(b)
            c = np.arange(n * 3_001, dtype=np.float64) * (r + 1) + i
            scattered = pg.reduce_scatter(c)
            d = np.full(7_777, i, np.int16) if r == i % n else np.zeros(7_777, np.int16)
            works.append(pg.broadcast(d, i % n, async_op=True))
            assert all(w is not None and w.wait(20.0) for w in works)
            got.append((a, gathered, scattered, d))
        return got

    for r, got in enumerate(run_on(gs, body, timeout=60.0)):
        for i, (a, gathered, scattered, d) in enumerate(got):
            assert (a == sum(k + i for k in range(size))).all(), (r, i)
            assert (gathered == (np.arange(size) * 10 + i)[:, None]).all(), (r, i)
            full = functools.reduce(np.add, [np.arange(size * 3_001, dtype=np.float64) * (k + 1) + i for k in range(size)])
            np.testing.assert_array_equal(scattered, full[r * 3_001 : (r + 1) * 3_001])
            assert (d == i).all(), (r, i)


def test_a_member_that_cannot_map_the_arena_keeps_the_whole_group_on_sockets(make_groups: MakeGroups,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    attach, calls = ShmArena.attach, []

    def refused_once(*args: Any) -> ShmArena:
        calls.append(1)
        if len(calls) == 1:  # one member (whichever maps first) is refused, as another user or a full /dev/shm would be
            raise PermissionError(errno.EACCES, "Permission denied")
        return attach(*args)
    monkeypatch.setattr(ShmArena, "attach", staticmethod(refused_once))
    gs = make_groups(3, 10.0)
    out = run_on(gs, lambda pg: pg.all_reduce(np.full(1 << 20, pg.rank + 1.0)) or pg.all_gather(np.ones(1 << 18)))
    assert len(calls) == 2 and all(arena_of(pg) is None and pg.backend.placement.arena_tried for pg in gs)  # type: ignore[union-attr]
    assert out[0].shape == (3, 1 << 18)
    monkeypatch.setattr(ShmArena, "attach", attach)
    tcp = TcpOptions.from_env()
    gs2 = thread_groups(2, options=[BackendOptions(timeout=10.0, tcp=tcp),  # the members' arena sizes differ
                                    BackendOptions(timeout=10.0, tcp=dataclasses.replace(tcp, shm_arena_bytes=1 << 20))])
    try:
        x = run_on(gs2, lambda pg: (lambda a: pg.all_reduce(a) or a)(np.full(1 << 18, pg.rank + 1.0)))
        assert all(arena_of(pg) is None for pg in gs2) and all((v == 3.0).all() for v in x)
    finally:
        for g in gs2:
            g.destroy()
    assert leftovers() == []


def test_an_arena_that_cannot_be_reserved_falls_back_to_sockets(make_groups: MakeGroups,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A full /dev/shm: posix_fallocate fails at creation (the arena's pages are reserved up front, so a full
    /dev/shm can never be a SIGBUS at first touch); the file is removed and the group stays on sockets."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    gs = make_groups(2, 10.0, transport="shm")
    x = run_on(gs, lambda pg: (lambda a: pg.all_reduce(a) or a)(np.full(1000, pg.rank + 1.0)))
    assert all(arena_of(pg) is None for pg in gs) and all((v == 3.0).all() for v in x)
    assert leftovers() == []


@pytest.mark.parametrize("transport", ["shm", "spin"])  # steps synchronized over the sockets / the mailbox
def test_mismatched_calls_raise_on_every_rank_naming_both_sides(make_groups: MakeGroups, transport: str) -> None:
    gs = make_groups(2, 5.0, transport=transport)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))  # the arena is up: the next calls take the path

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.all_reduce(np.ones(100_000, np.float32))
        else:
            pg.all_reduce(np.ones(120_000, np.float32))
    errors = run_on(gs, body, return_exceptions=True)
    for e in errors:
        assert isinstance(e, DistributedError), e
        assert "(float32, 100000 elements)" in str(e) and "(float32, 120000 elements)" in str(e), e

    gs = make_groups(2, 5.0, transport=transport)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))

    check_other_call_raises(gs, 1 << 16)


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
@pytest.mark.parametrize("transport", ["shm", "spin", "single_copy"])  # a silent peer on the single-copy path too
def test_a_silent_peer_times_out_on_the_shared_memory_path(make_groups: MakeGroups, transport: str) -> None:
    gs = make_groups(2, 1.0, transport=transport)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"all_reduce on group 'world' \(rank 0 of 2\): timed out after 1.0 s "
                                               r"waiting for peer 1"):
        gs[0].all_reduce(np.ones(1 << 16))
    assert time.monotonic() - t0 < 2.0


def _die_mid_stream(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Rank 1 kills itself after a few large all-reduces; the others keep going and must raise."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp", BackendOptions(timeout=5.0))
    all_reduce_until_killed(pg, np.ones(3_000_000, np.float32), 50, 3, q, lambda pg: arena_of(pg) is not None and (
        pg.backend.placement.mailbox is not None) == (pg.backend.tcp_options.shm_mailbox and ORDERED_STORES))  # type: ignore[union-attr]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("mailbox", [False, True])  # steps synchronized over the sockets / through the mailbox
def test_a_killed_process_makes_the_others_raise_promptly(monkeypatch: pytest.MonkeyPatch, mailbox: bool) -> None:
    monkeypatch.setenv("AXOND_SHM_MAILBOX", "1" if mailbox else "0")
    items, codes = collect_from_processes(_die_mid_stream, 3, expect=2)
    got = check_killed_rank_1(items, codes, 3)
    assert glob.glob(f"/dev/shm/axond-{got[0][3]}-*") == []


def _every_op() -> dict[str, Any]:
    pg = axond.distributed.default_group()
    return {**every_large_op(pg), "arena": arena_of(pg) is not None}


def test_real_processes_share_the_arena_and_leave_no_file() -> None:
    out = run_processes(_every_op, 3, timeout=60.0)
    check_every_large_op(out)
    assert all(got["arena"] for got in out)
    assert glob.glob(f"/dev/shm/axond-{out[0]['pid']}-*") == []
