"""ZeRO-1 copies in the worker daemon's memory (`axond.train.daemon_copy`): a copy written into a memfd is read back by
the next process on that memory; a copy cut half-way, of another layout or lineage, or of a step not committed
everywhere is never offered; a replacement rank's daemon copy rebuilds the lost shard bit for bit, as is or advanced by
the agreed step's gradient broadcast from a survivor."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.module import Parameter
from axond.nn.optim import AdamW
from axond.parallel.zero.virtual import VirtualZero, carried
from axond.testing import run_threads
from axond.train import daemon_copy
from axond.train.daemon_copy import DaemonCopy
from axond.train.reassemble import reassemble

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")


@pytest.fixture
def fd() -> Iterator[int]:
    fd = os.memfd_create("axond-test-shards")
    yield fd
    os.close(fd)


def _params(seed: int = 1) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return list(nn.Sequential(nn.Linear(5, 9, rng=rng), nn.Linear(9, 4, rng=rng)).parameters())


def _grads(params: list[Parameter], step: int) -> None:
    rng = np.random.default_rng(100 + step)  # the same averaged gradient on every rank, as the virtual-rank gather
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)


def _stepped(group: ProcessGroup, steps: int) -> VirtualZero:
    params = _params()
    zero = VirtualZero(params, AdamW, group, 3, lr=0.05)
    for step in range(1, steps + 1):
        _grads(params, step)
        zero.step()
    return zero


def _packed(zero: VirtualZero) -> tuple[np.ndarray, np.ndarray]:
    count = len(zero.mine)
    rows_shape, scalars_shape = zero.rows_shape(count)
    rows, scalars = np.empty(rows_shape, zero.flat.dtype), np.empty(scalars_shape)
    for i, v in enumerate(zero.mine):
        zero.pack(v, rows[i], scalars[i])
    return rows, scalars


def test_a_copy_outlives_its_writer_and_is_read_by_the_next_process_on_that_memory(fd: int) -> None:
    zero = _stepped(ProcessGroup.mock(), 3)
    writer = DaemonCopy(fd, zero)
    writer.post(lineage=0)
    writer.close()
    rows, scalars = _packed(zero)
    reader = DaemonCopy(fd, VirtualZero(_params(2), AdamW, ProcessGroup.mock(), 3, lr=0.05))  # a new rank
    held = reader.holding(3, 0)
    assert held is not None and held.shards == range(0, 3) and held.slots[0].tag == 3
    assert np.array_equal(held.slots[0].rows, rows) and np.array_equal(held.slots[0].scalars, scalars)
    assert reader.holding(2, 0) is None  # a copy of step 3 when step 2 was agreed: not committed everywhere
    assert reader.holding(5, 0) is None  # two steps old: nothing can advance it
    assert reader.holding(3, 1) is None  # from before a fall-back to a checkpoint (another lineage)
    other = VirtualZero(_params(), AdamW, ProcessGroup.mock(), 2, lr=0.05)  # another layout: 2 virtual shards
    assert DaemonCopy(fd, other).holding(3, 0) is None


def test_a_copy_cut_half_way_is_never_used_and_the_one_before_stays(fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params()
    zero = VirtualZero(params, AdamW, ProcessGroup.mock(), 3, lr=0.05)
    copies = DaemonCopy(fd, zero)
    for step in range(1, 3):
        _grads(params, step)
        zero.step()
        copies.post(lineage=0)
        copies.settle()
    two = _packed(zero)

    def dies_mid_copy(words: np.ndarray, rows: np.ndarray, sources: list[list[np.ndarray]], header: Any) -> None:
        np.copyto(rows[0, 0], sources[0][0])  # the first array copied, then the rank is killed: no header written

    _grads(params, 3)
    zero.step()
    monkeypatch.setattr(daemon_copy, "_write", dies_mid_copy)
    copies.post(lineage=0)
    copies.settle()
    reader = DaemonCopy(fd, VirtualZero(_params(2), AdamW, ProcessGroup.mock(), 3, lr=0.05))
    held = reader.holding(3, 0)  # step 3 was committed; its copy was cut: the copy of step 2 is offered, one step old
    assert held is not None and held.slots[0].tag == 2
    assert np.array_equal(held.slots[0].rows, two[0]) and np.array_equal(held.slots[0].scalars, two[1])
    assert reader.holding(2, 0) is not None and reader.holding(4, 0) is None


def test_a_header_whose_scalars_disagree_is_refused(fd: int) -> None:
    zero = _stepped(ProcessGroup.mock(), 2)
    copies = DaemonCopy(fd, zero)
    copies.post(lineage=0)
    copies.settle()
    held = copies.holding(2, 0)
    assert held is not None
    held.slots[0].scalars[0, 0] = 7  # the rows' own tag says another step than the header
    assert copies.holding(2, 0) is None


def test_a_descriptor_that_is_not_open_says_where_it_comes_from() -> None:
    fd = os.memfd_create("axond-test-closed")
    os.close(fd)
    with pytest.raises(ValueError, match=f"AXOND_SHARD_MEMORY_FD={fd} is not an open file descriptor"):
        DaemonCopy(fd, _stepped(ProcessGroup.mock(), 0))


def _faults_of_each_copy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The minor page faults each daemon copy takes on the thread that writes it (filled as copies run)."""
    faults: list[int] = []
    write = daemon_copy._write

    def counted(*args: Any) -> None:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        write(*args)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    monkeypatch.setattr(daemon_copy, "_write", counted)
    return faults


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs per-thread rusage (Linux)")
@pytest.mark.parametrize("populate", [True, False])
def test_both_slots_are_faulted_in_once_so_no_copy_stops_on_a_page_fault(fd: int, monkeypatch: pytest.MonkeyPatch,
                                                                          populate: bool) -> None:
    """A block of 3 MiB (770 pages per slot): with the mapping populated when it is made, neither slot's first copy
    faults (nor a new rank's on the same memory); without, each slot's first copy faults once per page."""
    if not populate:
        monkeypatch.setattr(daemon_copy, "POPULATE", 0)
    faults = _faults_of_each_copy(monkeypatch)
    rng = np.random.default_rng(3)
    params = list(nn.Linear(512, 512, rng=rng).parameters())
    zero = VirtualZero(params, AdamW, ProcessGroup.mock(), 1, lr=0.05)
    copies = DaemonCopy(fd, zero)
    for step in range(1, 4):
        for p in params:
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
        zero.step()
        copies.post(lineage=0)
        copies.settle()
    copies.close()
    again = DaemonCopy(fd, zero)  # the next rank on that memory maps it afresh
    again.post(lineage=0)
    again.close()
    pages = 3 * zero.shard * 4 // 4096
    if populate:
        assert max(faults) < pages // 20, faults
    else:
        assert faults[0] > pages // 2 and faults[1] > pages // 2 and faults[3] > pages // 2, faults
    held = again.holding(3, 0)
    assert held is not None and np.array_equal(held.slots[0].rows[0, 0], zero.flat)


def test_the_slots_views_are_made_once_per_layout(fd: int) -> None:
    zero = _stepped(ProcessGroup.mock(), 2)
    copies = DaemonCopy(fd, zero)
    copies.post(lineage=0)
    copies.settle()
    views = copies._slot_views(0, 3, 3, 2)
    for _ in range(3):
        copies.post(lineage=0)
        copies.settle()
    assert copies._slot_views(0, 3, 3, 2) is views and len(copies._views) == 2  # one per slot, reused every step


STEPS = 4


def _replaced(group: ProcessGroup, fd: int, last_copy_lands: bool) -> tuple[Any, np.ndarray, list[dict[str, Any]]]:
    """Three ranks step ZeRO-1; rank 2 copies its block into daemon memory after every step (the last one landed or
    not); then rank 2 is replaced by a fresh process (new parameters, no state) that offers that memory; the three
    rebuild every shard. Returns (the result, the parameters, the states carried)."""
    params = _params()
    zero = VirtualZero(params, AdamW, group, 3, lr=0.05)
    copies = DaemonCopy(fd, zero) if group.rank == 2 else None
    for step in range(1, STEPS + 1):
        _grads(params, step)
        zero.step()
        if copies is not None and (step < STEPS or last_copy_lands):
            copies.post(lineage=0)
            copies.settle()
        zero.publish()
    daemon = None
    if group.rank == 2:  # the replacement: what it knows comes from the daemon's memory only
        zero = VirtualZero(_params(9), AdamW, group, 3, lr=0.05)
        zero.tag = -1
        daemon = DaemonCopy(fd, zero).holding(STEPS, 0)
        assert daemon is not None and daemon.slots[0].tag == (STEPS if last_copy_lands else STEPS - 1)
    done = reassemble(zero, [], group, STEPS, daemon)
    return done, zero.flat.copy(), [dict(st) for st in zero.optim.state]


@pytest.mark.parametrize("last_copy_lands", [True, False])
def test_a_replacement_rebuilds_the_lost_shard_from_its_daemon_copy_bit_for_bit(fd: int, last_copy_lands: bool) -> None:
    whole = _stepped(ProcessGroup.mock(), STEPS)
    results = run_threads(lambda g: _replaced(g, fd, last_copy_lands), 3, 60.0)
    for rank, (done, flat, states) in enumerate(results):
        assert done.lost == [] and done.from_copies == [2] and done.from_daemon == [2]
        assert done.replayed == ([] if last_copy_lands else [2])  # advanced by the survivors' gradient of step 4
        assert np.array_equal(flat, whole.flat)
        for st, v in zip(states, carried(rank, 3, 3)):
            want = whole.optim.state[v]
            assert st["step"] == want["step"] == STEPS
            for key in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(st[key], want[key]), (rank, v, key)
