"""The compiled mailbox's wait (`_fastbox.Box.wait` / `publish`): a rank that blocks on a member's sequence word (a
futex on the shared mapping) is woken by that member's post, in another process too; a wait that nobody wakes ends
at its own limit; the waiter count it leaves in the slot is back to zero; the presence table says where a rank was
last seen; a rank woken off its home core goes back there, also while its waits block. Through a group: a rank
blocked in a small op raises naming the op and the peer when the peer stays silent (the group's timeout) or dies
(its socket), instead of waiting on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import time
from typing import Any

import numpy as np
import pytest

from axond import DistributedError
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import ORDERED_STORES
from axond.distributed.backends.tcp.shm import mailbox
from axond.testing import collect_from_processes, run_on, thread_groups

fastbox = mailbox._fastbox
pytestmark = [pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86 store order"),
              pytest.mark.skipif(fastbox is None, reason="the compiled helper was not built (no C compiler)")]

SLOT = 4096
SIZE = 2
WAITERS = 88
"""Byte offset in a slot of the count of ranks blocked on its sequence word (`_fastbox.c`, WAITERS_OFF)."""
LIMIT = 30.0
"""How long a test's blocked wait may last before it gives up (its configured limit, never reached when it works)."""


def shared_mapping() -> Any:
    """Two buffers of SIZE + 1 slots, shared with forked children."""
    import mmap

    return mmap.mmap(-1, 2 * (SIZE + 1) * SLOT, mmap.MAP_SHARED)


def blocking_box(mapping: Any, rank: int) -> Any:
    """A box whose waits neither poll nor yield: they block at once."""
    return fastbox.Box(mapping, 0, poll_ns=0, block_ns=0, slot=SLOT, size=SIZE, rank=rank)


def waiters(mapping: Any, slot: int) -> int:
    return int(struct.unpack_from("<i", mapping, slot + WAITERS)[0])


def _post_once_blocked(mapping: Any, slot: int, k: int) -> None:
    """The poster: once the other process counts itself as blocked on `slot`, post op `k` there (then exit)."""
    box = blocking_box(mapping, 1)
    deadline = time.monotonic() + LIMIT
    while waiters(mapping, slot) == 0 and time.monotonic() < deadline:
        os.sched_yield()
    box.publish(slot, k)
    box.close()


def test_a_post_wakes_a_rank_blocked_on_it_in_another_process() -> None:
    mapping = shared_mapping()
    box = blocking_box(mapping, 0)
    slot = 1 * SLOT  # rank 1's slot of buffer 0
    poster = mp.get_context("fork").Process(target=_post_once_blocked, args=(mapping, slot, 7), daemon=True)
    poster.start()
    t0 = time.monotonic()
    assert box.wait([slot], 7, LIMIT)
    assert time.monotonic() - t0 < LIMIT, "woken by its limit, not by the post"
    assert box.blocks >= 1, "it never blocked"
    poster.join(LIMIT)
    assert poster.exitcode == 0
    assert waiters(mapping, slot) == 0
    assert struct.unpack_from("<q", mapping, slot)[0] == 7
    box.close()


def test_a_wait_nobody_wakes_ends_at_its_limit_and_counts_itself_out() -> None:
    mapping = shared_mapping()
    box = blocking_box(mapping, 0)
    t0 = time.monotonic()
    assert not box.wait([SLOT], 1, 0.05)
    assert time.monotonic() - t0 >= 0.05
    assert box.blocks >= 1 and waiters(mapping, SLOT) == 0
    box.publish(SLOT, 1)  # nobody blocks: no wake-up needed, and the next wait sees the post at once
    assert box.wait([SLOT], 1, 0.0)
    box.close()


def test_a_post_says_where_the_rank_runs_and_a_wait_checks_its_arguments() -> None:
    mapping = shared_mapping()
    box = blocking_box(mapping, 1)
    box.publish(SLOT, 3)
    table = SIZE * SLOT  # the spare slot of buffer 0
    assert struct.unpack_from("<i", mapping, table + 8 * 1)[0] - 1 in os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="outside the mapping"):
        box.wait([len(mapping)], 1, 0.0)
    with pytest.raises(ValueError):
        fastbox.Box(mapping, 0, slot=SLOT, size=SIZE, rank=SIZE)  # no such rank
    box.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.wait([SLOT], 1, 0.0)


def blocking_groups(n: int, timeout: float) -> list[Any]:
    """Thread groups whose mailbox waits block at once (AXOND_SHM_POLL_US=0), on every host."""
    return thread_groups(n, options=BackendOptions(timeout=timeout, tcp=TcpOptions(shm_poll_us=0)))


def test_a_rank_blocked_on_a_silent_peer_times_out_naming_the_op_and_the_peer() -> None:
    gs = blocking_groups(3, 1.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(3)))
    run_on(gs, lambda pg: pg.all_reduce(np.ones(3)))  # prepared: the compiled op from here on
    errors = run_on(gs[:2], lambda pg: pg.all_reduce(np.ones(3)), return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "all_reduce" in str(e) for e in errors), errors
    assert any("timed out after 1.0 s waiting for peer 2" in str(e) for e in errors), errors
    assert all(pg.backend.placement.mailbox.native.blocks > 0 for pg in gs[:2])  # type: ignore[union-attr]
    for pg in gs:
        pg.destroy()


def _die_while_the_other_blocks(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Rank 1 posts nothing more after a few all_reduces and dies once rank 0 blocks on it; rank 0 must raise."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp",
                      BackendOptions(timeout=LIMIT, tcp=TcpOptions(shm_poll_us=0)))
    x = np.ones(16, np.float32)
    for _ in range(3):
        pg.all_reduce(x)
    box = pg.backend.placement.mailbox.native  # type: ignore[union-attr]
    if rank == 1:
        slot = pg.backend.placement.mailbox.base[(box.ops + 1) & 1][1]  # type: ignore[union-attr]
        deadline = time.monotonic() + LIMIT
        while waiters(pg.backend.placement.mailbox.mapping, slot) == 0 and time.monotonic() < deadline:  # type: ignore[union-attr]
            os.sched_yield()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        pg.all_reduce(x)
        q.put((rank, "no error", 0.0, box.blocks))
    except DistributedError as e:
        q.put((rank, str(e), time.monotonic() - t0, box.blocks))
    pg.destroy()


def test_a_peer_that_dies_while_a_rank_blocks_on_it_makes_it_raise() -> None:
    items, codes = collect_from_processes(_die_while_the_other_blocks, 2, expect=1, timeout=LIMIT + 30)
    rank, msg, took, blocks = items[0]
    assert rank == 0 and codes[1] == -signal.SIGKILL
    assert "all_reduce" in msg and "rank 1" in msg, msg
    assert took < LIMIT, "it waited for the group's timeout instead of seeing the dead peer"
    assert blocks > 0


def test_the_waits_stop_yielding_where_yields_cost_more_than_their_limit_and_try_again_now_and_then() -> None:
    """A box with turns measures its yields (`judge` in `_fastbox.c`): it keeps yielding while they took at most its
    limit lately (here 1 s), stops as soon as they took more (a limit of 0), and then every 16 ops one wait yields
    again to see. The member waited for never posts: every wait yields, then ends at its own limit (1 ms)."""
    mapping = shared_mapping()
    box = fastbox.Box(mapping, 4, poll_ns=0, block_ns=0, yield_limit_ns=10**9, slot=SLOT, size=SIZE, rank=0)
    for _ in range(3):
        assert not box.wait([SLOT], 1, 0.001)
    assert box.yielding and 0 < box.yield_cost <= 1_000_000 and box.probes == 0
    assert box.blocks >= 3 and waiters(mapping, SLOT) == 0
    box.close()

    box = fastbox.Box(mapping, 4, poll_ns=0, block_ns=0, yield_limit_ns=0, probe_ops=1024, slot=SLOT, size=SIZE, rank=0)
    assert box.yielding
    assert not box.wait([SLOT], 1, 0.001)
    assert not box.yielding and box.yield_cost > 0
    cost = box.yield_cost
    assert not box.wait([SLOT], 1, 0.001)  # blocks at once: nothing to measure
    assert box.yield_cost == cost and box.probes == 0
    box.ops = 16
    assert not box.wait([SLOT], 1, 0.001)  # the try: it yields, and costs more than the limit again
    assert box.probes == 1 and not box.yielding
    box.close()


def _spin_on(core: int, stop: Any) -> None:
    """A busy loop on `core` until `stop` is set (at most LIMIT)."""
    os.sched_setaffinity(0, {core})
    deadline = time.monotonic() + LIMIT
    while not stop.is_set() and time.monotonic() < deadline:
        pass


def _post_from(core: int, mapping: Any, slot: int, k: int) -> None:
    os.sched_setaffinity(0, {core})
    _post_once_blocked(mapping, slot, k)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores this process may run on")
def test_a_rank_woken_off_its_home_core_goes_back_there_also_while_its_waits_block() -> None:
    """Four ranks on two cores beside a busy loop block in their waits (yields would run the loop), and the kernel
    wakes a blocked rank where a core is free: without a move back they end up on one core while the loop has the
    other. Here the home core runs a busy loop, the rank blocks on the other core and is woken there by a post from
    that core: each wake that finds it off its home moves it back (`Box.moves`), unpinned."""
    from axond.distributed.backends.tcp.shm.spread import current_cpu, move_to

    mask = sorted(os.sched_getaffinity(0))
    home, other = mask[0], mask[1]
    mapping = shared_mapping()
    box = fastbox.Box(mapping, 4, poll_ns=0, block_ns=0, yield_limit_ns=0, slot=SLOT, size=SIZE, rank=0)
    box.home = home
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spinner = ctx.Process(target=_spin_on, args=(home, stop), daemon=True)
    spinner.start()
    slot = 1 * SLOT
    try:
        assert not box.wait([slot], 1, 0.001) and not box.yielding  # its yields cost more than its limit (0): it blocks
        for k in range(1, 6):
            assert move_to(other)  # off its home, as the kernel's balancer leaves it
            poster = ctx.Process(target=_post_from, args=(other, mapping, slot, k), daemon=True)
            poster.start()
            assert box.wait([slot], k, LIMIT)
            poster.join(LIMIT)
            assert poster.exitcode == 0
        assert box.blocks >= 5
        assert box.moves >= 1, "woken on the other core, it stayed there"
        assert sorted(os.sched_getaffinity(0)) == mask  # moved, not pinned
        assert current_cpu() in mask
    finally:
        stop.set()
        spinner.join(LIMIT)
        os.sched_setaffinity(0, set(mask))
        box.close()
