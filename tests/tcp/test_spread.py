"""Ranks of one host left on one core by the scheduler are moved apart when their mailbox is mapped
(`shm.spread`): the plan every member computes, and the move itself (the core each member reads faked, the
affinity calls real)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from axond import ProcessGroup
from axond.distributed import BackendOptions
from axond.distributed.backends.tcp.policy import ORDERED_STORES
from axond.distributed.backends.tcp.shm import mailbox
from axond.distributed.backends.tcp.shm import spread as spread_module
from axond.distributed.backends.tcp.shm.spread import plan
from axond.testing import run_on, thread_groups


def test_members_on_a_taken_core_move_in_rank_order_to_free_cores_of_their_own_masks() -> None:
    every = {0, 1, 2, 3}
    assert plan([0, 1], [every, every]) == {}
    assert plan([0, 0], [every, every]) == {1: 1}
    assert plan([2, 2, 2, 0], [every] * 4) == {1: 1, 2: 3}
    assert plan([1, 1], [every, {1}]) == {}  # its mask has no other core: it stays
    assert plan([-1, 0], [every, every]) == {0: 1}  # a member that could not tell its core counts as on none
    two = {0, 1}
    assert plan([0, 0, 0], [two, two, two]) == {1: 1}  # more members than cores: member r to core r mod 2
    assert plan([1, 1, 1, 0], [two] * 4) == {0: 0, 2: 0, 3: 1}  # whatever the cores read (stale by then)
    assert plan([0, 1, 0, 1], [two] * 4) == {}  # there already
    assert plan([0, 0, 0, 0], [two, two, two, {0}]) == {1: 1}  # the pinned one stays
    assert plan([5, 5, 5], [{4, 5}] * 3) == {0: 4, 2: 4}  # the cores of their masks, in order


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may run on")
@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox (and the spreading with it) needs x86's ordered stores")
@pytest.mark.parametrize("shared", [True, False])
def test_the_higher_rank_on_a_shared_core_moves_and_stays_unpinned(monkeypatch: pytest.MonkeyPatch,
                                                                   capfd: pytest.CaptureFixture[str],
                                                                   shared: bool) -> None:
    """Two ranks (threads) told they run on one core (or on two) when their mailbox is mapped: rank 1 moves to
    the other core of its mask, once, and its mask is whole again afterwards; rank 0 stays."""
    mask = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("AXOND_DEBUG", "1")
    cores = iter([mask[0], mask[0]] if shared else mask[:2])  # what the two members read, one call each
    monkeypatch.setattr(spread_module, "current_cpu", lambda: next(cores))
    groups = thread_groups(2, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> tuple[float, list[int]]:
            x = np.ones(2, np.float32)
            pg.all_reduce(x)  # maps the mailbox: the spreading
            pg.all_reduce(x)  # once only
            return float(x[0]), sorted(os.sched_getaffinity(0))
        out = run_on(groups, body)
    finally:
        for g in groups:
            g.destroy()
    assert out == [(4.0, mask), (4.0, mask)]
    err = capfd.readouterr().err
    moved = [line for line in err.splitlines() if "moved from core" in line]
    if shared:
        assert len(moved) == 1 and "rank 1 of 2" in moved[0] and f"to core {mask[1]}" in moved[0], err
    else:
        assert moved == [], err


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may run on")
@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox (and the spreading with it) needs x86's ordered stores")
def test_a_member_pinned_to_one_core_still_takes_part_in_the_exchange() -> None:
    """Rank 1 runs pinned to one core (a launcher's binding), rank 0 may run anywhere: both exchange their cores when
    the mailbox is mapped (a member that left it out made its peer read its op as the exchange: a mismatch), and the
    op runs."""
    mask = sorted(os.sched_getaffinity(0))
    groups = thread_groups(2, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> tuple[float, list[int]]:
            if pg.rank == 1:
                os.sched_setaffinity(0, {mask[0]})
            try:
                x = np.ones(2, np.float32)
                pg.all_reduce(x)  # maps the mailbox: the exchange
                return float(x[0]), sorted(os.sched_getaffinity(0))
            finally:
                os.sched_setaffinity(0, mask)
        out = run_on(groups, body)
    finally:
        for g in groups:
            g.destroy()
    assert out == [(2.0, mask), (2.0, [mask[0]])]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not 2 <= len(os.sched_getaffinity(0)) <= 4,
                    reason="needs two to four cores this process may run on (one more rank than cores)")
@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox (and the spreading with it) needs x86's ordered stores")
def test_more_ranks_than_cores_get_a_home_core_each() -> None:
    """One rank more than cores: rank r's home is core r mod cores (`Mailbox.home`, the compiled ops' too), and every
    mask is whole afterwards."""
    mask = sorted(os.sched_getaffinity(0))
    n = len(mask) + 1
    groups = thread_groups(n, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> tuple[int | None, int, list[int]]:
            pg.barrier()  # maps the mailbox: the spreading
            box = pg.backend.placement.mailbox  # type: ignore[union-attr]
            return box.home, box.native.home if box.native is not None else -2, sorted(os.sched_getaffinity(0))
        out = run_on(groups, body)
    finally:
        for g in groups:
            g.destroy()
    homes = [mask[r % len(mask)] for r in range(n)]
    assert [home for home, _, _ in out] == homes and all(cores == mask for *_, cores in out)
    assert all(native in (home, -2) for home, native, _ in out)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores this process may run on")
@pytest.mark.skipif(getattr(mailbox, "_fastbox", None) is None, reason="the compiled helper was not built")
def test_the_compiled_ops_move_a_rank_back_to_its_home_core() -> None:
    """A thread that the kernel moved off its home core (here: its mask narrowed to another core and set back) is
    moved back by `Box.go_home` (what every 64th compiled op runs), unpinned; at home, or without a home, it stays."""
    import mmap

    mask = sorted(os.sched_getaffinity(0))
    mapping = mmap.mmap(-1, 4096)
    box = mailbox._fastbox.Box(mapping, 4)
    try:
        assert box.home == -1 and not box.go_home()  # no home: nothing to do
        box.home = mask[0]
        os.sched_setaffinity(0, {mask[1]})
        os.sched_setaffinity(0, set(mask))
        assert spread_module.current_cpu() == mask[1]
        assert box.go_home() and box.moves == 1
        assert spread_module.current_cpu() == mask[0] and sorted(os.sched_getaffinity(0)) == mask
        assert not box.go_home() and box.moves == 1  # home already
    finally:
        os.sched_setaffinity(0, set(mask))
        box.close()
        mapping.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) != 2,
                    reason="needs exactly two cores this process may run on (three ranks, a pair of them)")
@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox (and the spreading with it) needs x86's ordered stores")
def test_a_subgroup_keeps_the_home_its_rank_got_from_the_first_group(monkeypatch: pytest.MonkeyPatch,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Three ranks on two cores get homes 0, 1, 0 (of their mask); a subgroup of ranks 0 and 2, which share core 0,
    would move rank 2 to the free core, away from its home: it keeps the home and moves nothing, and the home is
    given up once both mailboxes closed."""
    mask = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("AXOND_DEBUG", "1")
    groups = thread_groups(3, options=BackendOptions(timeout=10.0))
    try:
        threads: list[threading.Thread] = []

        def body(pg: ProcessGroup) -> tuple[int | None, int | None]:
            threads.append(threading.current_thread())
            pg.barrier()  # the world's mailbox: homes
            sub = pg.new_group([0, 2])
            if pg.rank == 1:
                return pg.backend.placement.mailbox.home, None  # type: ignore[union-attr]
            try:
                monkeypatch.setattr(spread_module, "current_cpu", lambda: mask[0])  # both report core 0
                sub.barrier()  # the subgroup's mailbox
                return pg.backend.placement.mailbox.home, sub.backend.placement.mailbox.home  # type: ignore[union-attr]
            finally:
                sub.destroy()
        out = run_on(groups, body)
    finally:
        for g in groups:
            g.destroy()
    assert out == [(mask[0], mask[0]), (mask[1], None), (mask[0], mask[0])]
    err = capfd.readouterr().err
    assert "rank 1 of 2" not in err, err  # the subgroup's rank 2 did not move
    assert not [t for t in threads if t in spread_module._HOMES], dict(spread_module._HOMES)  # given up
