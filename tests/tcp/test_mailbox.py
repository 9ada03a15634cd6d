"""Small ops of a group on one node through its shared-memory mailbox: when it is used, rank-order numbers, buffer
reuse across ops of every kind (with socket ops in between), mismatches, silent and dead peers, and the knobs.

Every small collective also runs through it in test_collectives (transport "auto") and the random programs.
"""

from __future__ import annotations

import functools
import glob
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup, ReduceOp
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import ORDERED_STORES, mailbox_limit
from axond.distributed.backends.tcp.transport.wire import Op
from axond.testing import collect_from_processes, run_on
from collective_cases import all_reduce_until_killed

pytestmark = pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86 store order")
MakeGroups = Any


def mailbox_of(pg: ProcessGroup) -> Any:
    return pg.backend.placement.mailbox  # type: ignore[union-attr]


def mailbox_ops(pg: ProcessGroup) -> int:
    return pg.backend.placement.mailbox.ops  # type: ignore[union-attr]


def test_small_ops_use_the_mailbox_and_larger_ones_the_sockets(make_groups: MakeGroups,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_SHM_MIN_BYTES", str(1 << 40))  # no arena (its steps would post in the mailbox too)
    gs = make_groups(3, 10.0)
    out = run_on(gs, lambda pg: (lambda x: pg.all_reduce(x) or x)(np.full(mailbox_limit(Op.ALL_REDUCE, 3) // 8, pg.rank + 1.0)))
    assert all(mailbox_of(pg) is not None and mailbox_ops(pg) == 1 for pg in gs)
    assert all((x == 6.0).all() for x in out)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(mailbox_limit(Op.ALL_REDUCE, 3) // 8 + 1)))
    assert all(mailbox_ops(pg) == 1 for pg in gs)
    assert glob.glob(f"/dev/shm/axond-{os.getpid()}-*") == []  # unlinked once every member mapped it


@pytest.mark.parametrize("crowded", [False, True])
def test_the_arena_steps_synchronize_through_the_mailbox(make_groups: MakeGroups, crowded: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena maps the mailbox too, and each of its steps is one mailbox round (no system calls), whether or not
    the host's ranks outnumber its cores (with the mailbox off they synchronize over the sockets: transport "shm")."""
    monkeypatch.setenv("AXOND_SHM_SINGLE_COPY", "0")  # the arena, not the single-copy path
    gs = make_groups(2, 10.0, crowded=crowded)
    slot = gs[0].backend.tcp_options.shm_arena_bytes // 6  # type: ignore[union-attr]  # 2 buffers of 3 slots, up to 4 MiB
    rows = 3 * min(slot, 4 << 20) // 8  # an all_gather in 3 steps (a slot per rank each)
    out = run_on(gs, lambda pg: pg.all_gather(np.full(rows, pg.rank + 1.0)))
    assert all((o == [[1.0], [2.0]]).all() for o in out)
    assert all(pg.backend.placement.arena is not None and mailbox_of(pg) is not None for pg in gs)  # type: ignore[union-attr]
    assert all(mailbox_ops(pg) == 3 for pg in gs)


@pytest.mark.parametrize("setting", ["AXOND_SHM_MAILBOX=0", "AXOND_SHM=0"])
def test_the_mailbox_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, make_groups: MakeGroups, setting: str) -> None:
    monkeypatch.setenv(*setting.split("="))
    gs = make_groups(2, 10.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(3)) or pg.barrier())
    assert all(mailbox_of(pg) is None for pg in gs)
    monkeypatch.setenv("AXOND_SHM_MAILBOX", "sometimes")
    with pytest.raises(ValueError, match="AXOND_SHM_MAILBOX='sometimes'"):
        TcpOptions.from_env()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_every_small_op_back_to_back_with_socket_ops_between(make_groups: MakeGroups, size: int) -> None:
    """Mailbox ops of every kind alternate buffers; gathers and point-to-point ops (on the sockets, where a rank can
    run ahead of its peers) come between them, so a fast rank posts again while slow ones still read."""
    gs = make_groups(size, 20.0)
    rng = np.random.default_rng(size)
    floats = [rng.standard_normal(101) for _ in range(size)]

    def body(pg: ProcessGroup) -> list[Any]:
        r, n, got = pg.rank, pg.size, []
        for i in range(30):
            if r == i % n:
                time.sleep(0.002)  # one straggler per round
            x = floats[r] * (i + 1)
            pg.all_reduce(x)
            b = np.full(7, r * 100 + i, np.int16)
            pg.broadcast(b, i % n)
            gathered = pg.all_gather(np.full(5, r + i, np.int32))
            scattered = pg.reduce_scatter(np.arange(n * 3, dtype=np.int64) * (r + 1) + i, ReduceOp.MAX)
            pg.gather(np.full(2, r), dst=0)  # sockets: non-root ranks return at once
            pg.barrier()
            got.append((x, b, gathered, scattered))
        return got

    want_sum = functools.reduce(np.add, floats)  # rank order, as one process adds them
    for r, got in enumerate(run_on(gs, body, timeout=60.0)):
        for i, (x, b, gathered, scattered) in enumerate(got):
            np.testing.assert_array_equal(x, functools.reduce(np.add, [f * (i + 1) for f in floats]))
            assert (b == (i % size) * 100 + i).all()
            assert (gathered == (np.arange(size) + i)[:, None]).all()
            np.testing.assert_array_equal(scattered, np.arange(r * 3, r * 3 + 3) * size + i)
    assert want_sum.shape == (101,)
    assert all(mailbox_ops(pg) == 30 * 5 for pg in gs)


def test_mismatched_calls_raise_on_every_rank_naming_both_sides(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 5.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(2)))

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 2:
            pg.broadcast(np.ones(4, np.float32), 0)
        else:
            pg.all_reduce(np.ones(4, np.float32))
    errors = run_on(gs, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in errors), errors
    assert all("broadcast" in str(e) and "all_reduce" in str(e) for e in errors), errors


def prepared(pg: ProcessGroup) -> int:
    return len(pg.fast_path)


@pytest.mark.parametrize("dtype, op", [(np.float64, ReduceOp.SUM), (np.float32, ReduceOp.AVG), (np.int32, ReduceOp.MAX),
                                       (np.uint8, ReduceOp.BXOR)])
def test_a_repeated_small_all_reduce_runs_prepared_with_the_same_numbers(make_groups: MakeGroups, dtype: type,
                                                                          op: ReduceOp) -> None:
    """The first small all_reduce of a dtype, size and op prepares it; the next ones skip the checks and the route and
    give the numbers of one process reducing in rank order, with other ops and shapes between them."""
    gs = make_groups(3, 10.0)
    rng = np.random.default_rng(7)
    data = [(rng.standard_normal((20, 5)) * 50).astype(dtype) for _ in range(3)]
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum, ReduceOp.BXOR: np.bitwise_xor}[op]

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        got = []
        for i in range(12):
            x = data[pg.rank] + dtype(i % 3)
            pg.all_reduce(x, op)
            got.append(x)
            if i % 4 == 1:
                pg.all_reduce(np.ones(3, np.float32))  # another prepared form in between
                pg.barrier()
        return got

    for got in run_on(gs, body):
        for i, x in enumerate(got):
            want = functools.reduce(lambda a, b: ufunc(a, b), [d + dtype(i % 3) for d in data])
            if op is ReduceOp.AVG:
                want = want / dtype(3)
            np.testing.assert_array_equal(x, want.astype(dtype))
    assert all(prepared(pg) == 3 for pg in gs)  # both all_reduces and the barrier


def test_a_mismatch_with_a_prepared_all_reduce_raises_on_every_rank(make_groups: MakeGroups) -> None:
    """Rank 0 runs its prepared all_reduce, the others another op of the same size: all raise, naming both."""
    gs = make_groups(3, 5.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(4, np.float32)))
    assert all(prepared(pg) == 1 for pg in gs)

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.all_reduce(np.ones(4, np.float32))
        else:
            pg.all_reduce(np.ones(4, np.float32), ReduceOp.MAX)
    errors = run_on(gs, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in errors), errors
    assert all("all_reduce" in str(e) and "MAX" in str(e) for e in errors), errors


def test_a_repeated_small_broadcast_runs_prepared_from_every_root(make_groups: MakeGroups) -> None:
    """Every root's broadcast is prepared on its own."""
    gs = make_groups(2, 10.0)

    def step(pg: ProcessGroup, i: int) -> np.ndarray:
        x = np.full((4, 3), pg.rank * 10 + i, np.int16)
        pg.broadcast(x, i % 2)
        return x

    for got in run_on(gs, lambda pg: [step(pg, i) for i in range(8)]):
        for i, x in enumerate(got):
            assert (x == (i % 2) * 10 + i).all()
    assert all(prepared(pg) == 2 for pg in gs)  # one per root


def test_a_repeated_small_all_gather_runs_prepared_into_fresh_and_given_outputs(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 10.0)

    def step(pg: ProcessGroup, i: int) -> np.ndarray:
        x = np.full((2, 5), pg.rank * 10 + i, np.float32)
        if i % 2 == 0:
            return pg.all_gather(x)
        out = np.zeros((3, 2, 5), np.float32)
        assert pg.all_gather(x, out=out) is out
        return out

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        got = [step(pg, i) for i in range(6)]
        with pytest.raises(ValueError, match="out= must be"):  # a wrong out= still gets the full way's error
            pg.all_gather(np.ones((2, 5), np.float32), out=np.zeros((3, 10), np.float32))
        return got

    for got in run_on(gs, body):
        for i, out in enumerate(got):
            assert out.shape == (3, 2, 5) and all((out[r] == r * 10 + i).all() for r in range(3))
    assert all(prepared(pg) == 1 for pg in gs)


@pytest.mark.parametrize("dtype, op", [(np.float64, ReduceOp.SUM), (np.float32, ReduceOp.AVG),
                                       (np.int32, ReduceOp.MAX)])
def test_a_repeated_small_reduce_scatter_runs_prepared_with_the_same_numbers(make_groups: MakeGroups, dtype: type,
                                                                              op: ReduceOp) -> None:
    """Into fresh and given outputs, with other ops between; the numbers of one process reducing in rank order."""
    gs = make_groups(3, 10.0)
    rng = np.random.default_rng(11)
    data = [(rng.standard_normal((6, 4)) * 50).astype(dtype) for _ in range(3)]
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MAX: np.maximum}[op]

    def step(pg: ProcessGroup, i: int) -> np.ndarray:
        x = data[pg.rank] + dtype(i)
        if i % 2 == 0:
            return pg.reduce_scatter(x, op)
        out = np.zeros((2, 4), dtype)
        assert pg.reduce_scatter(x, op, out=out) is out
        if i % 3 == 1:
            pg.all_reduce(np.ones(3, np.float32))
        return out

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        got = [step(pg, i) for i in range(6)]
        with pytest.raises(ValueError, match="out= must be"):  # a wrong out= still gets the full way's error
            pg.reduce_scatter(data[pg.rank], op, out=np.zeros((3, 4), dtype))
        return got

    for r, got in enumerate(run_on(gs, body)):
        for i, out in enumerate(got):
            want = functools.reduce(lambda a, b: ufunc(a, b), [d + dtype(i) for d in data])
            if op is ReduceOp.AVG:
                want = want / dtype(3)
            np.testing.assert_array_equal(out, want.astype(dtype)[2 * r : 2 * r + 2])
    assert all(prepared(pg) == 2 for pg in gs)  # the reduce_scatter and the all_reduce


FIRST_AND_MISMATCHED = {
    "broadcast": (lambda pg: pg.broadcast(np.ones(4, np.float32), 0),
                  lambda pg: pg.broadcast(np.ones(4, np.float32), 0 if pg.rank == 0 else 1)),
    "all_gather": (lambda pg: pg.all_gather(np.ones(4, np.float32)),
                   lambda pg: pg.all_gather(np.ones(4 if pg.rank == 0 else 5, np.float32))),
    "reduce_scatter": (lambda pg: pg.reduce_scatter(np.ones(4, np.float32)),
                       lambda pg: pg.reduce_scatter(np.ones(4, np.float32),
                                                    ReduceOp.SUM if pg.rank == 0 else ReduceOp.MAX)),
    "barrier": (lambda pg: pg.barrier(),
                lambda pg: pg.barrier() if pg.rank == 0 else pg.all_reduce(np.ones(1, np.uint8))),
}


@pytest.mark.parametrize("op", sorted(FIRST_AND_MISMATCHED))
def test_a_mismatch_with_a_prepared_op_raises_on_every_rank(make_groups: MakeGroups, op: str) -> None:
    """Rank 0 runs its prepared op again; the other calls it with another root, size or reduction, or calls another
    op: both raise."""
    first, mismatched = FIRST_AND_MISMATCHED[op]
    gs = make_groups(2, 5.0)
    run_on(gs, first)
    errors = run_on(gs, mismatched, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and op in str(e) for e in errors), errors


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
@pytest.mark.parametrize("op", ["all_reduce", "barrier"])
def test_a_silent_peer_times_out_in_a_prepared_op(make_groups: MakeGroups, op: str) -> None:
    gs = make_groups(3, 1.0)
    call = (lambda pg: pg.all_reduce(np.ones(3))) if op == "all_reduce" else (lambda pg: pg.barrier())
    run_on(gs, call)
    t0 = time.monotonic()
    errors = run_on(gs[:2], call, return_exceptions=True)
    assert 0.9 < time.monotonic() - t0 < 3.0
    assert all(isinstance(e, DistributedError) for e in errors), errors
    assert any("timed out after 1.0 s waiting for peer 2" in str(e) for e in errors), errors
    with pytest.raises(DistributedError, match="aborted"):
        gs[0].all_reduce(np.ones(3))  # the failure aborted the group: the prepared form is not taken


def test_a_peer_in_a_socket_op_makes_both_raise(make_groups: MakeGroups) -> None:
    """A small op against a large one. When the large one sends first, the mailbox side sees the frame of another op
    on its socket and raises at once."""
    gs = make_groups(2, 1.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(2)) or pg.all_reduce(np.ones(1 << 14)))  # mailbox and arena up
    t0 = time.monotonic()
    errors = run_on(gs, lambda pg: pg.all_reduce(np.ones(4 if pg.rank == 0 else 1 << 14)), return_exceptions=True)
    assert time.monotonic() - t0 < 0.9
    assert all(isinstance(e, DistributedError) and "all_reduce" in str(e) for e in errors), errors
    assert any("4 elements" in str(e) or "(4,)" in str(e) or "count 4" in str(e) for e in errors), errors


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("case", ["arena set-up", "broadcast", "sockets only", "root sends"])
def test_a_peer_waiting_to_receive_in_a_socket_op_makes_both_raise_early(
        monkeypatch: pytest.MonkeyPatch, make_groups: MakeGroups, case: str) -> None:
    """A small op against a larger one that starts by receiving from the mailbox side (the arena's set-up, a
    broadcast's non-root), or that sends more than the sockets hold (the root of a large broadcast, once the mailbox
    side stopped reading): each waits for the other, until the waiting side's socket wait wakes up, finds the peer's
    mailbox post under its own op's number, and raises naming both calls; the peer gets its abort frame. Well
    before the timeout (10 s)."""
    if case in ("sockets only", "root sends"):
        monkeypatch.setenv("AXOND_SHM_MIN_BYTES", str(1 << 40))
    gs = make_groups(3, 10.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(2)))  # mailbox up, arena not yet

    def body(pg: ProcessGroup) -> None:
        if case == "arena set-up":
            pg.all_reduce(np.ones(4 if pg.rank == 0 else 1 << 16))
        elif case == "root sends":
            if pg.rank == 1:
                pg.broadcast(np.ones(8 << 20), 1)  # 64 MiB: more than the socket buffers take
            else:
                pg.all_reduce(np.ones(4))
        elif pg.rank == 0:
            pg.all_reduce(np.ones(4))
        else:
            pg.broadcast(np.ones(1 << 18), 0)
    t0 = time.monotonic()
    errors = run_on(gs, body, return_exceptions=True)
    assert time.monotonic() - t0 < 2.5
    assert all(isinstance(e, DistributedError) for e in errors), errors
    want = "broadcast" if case != "arena set-up" else "all_reduce"
    assert all(want in str(e) and "timed out" not in str(e) for e in errors), errors
    assert any("all_reduce" in str(e) and "4 elements" in str(e) and "called" in str(e) for e in errors), errors


def test_different_mailbox_settings_raise_instead_of_waiting(make_groups: MakeGroups) -> None:
    """A member whose mailbox is off (here: dropped after set-up, its watch kept) runs a small op on the sockets
    while the others post it in the mailbox: it raises, saying the settings must match, and so do they."""
    gs = make_groups(2, 10.0)
    run_on(gs, lambda pg: pg.all_reduce(np.ones(2)))
    placement = gs[1].backend.placement  # type: ignore[union-attr]
    box, placement.mailbox = placement.mailbox, None
    t0 = time.monotonic()
    errors = run_on(gs, lambda pg: pg.all_reduce(np.ones(2)), return_exceptions=True)
    assert time.monotonic() - t0 < 2.5
    assert all(isinstance(e, DistributedError) for e in errors), errors
    assert all("AXOND_SHM_MAILBOX alike on every rank" in str(e) for e in errors), errors
    box.close()


def test_a_send_that_arrives_during_a_mailbox_wait_is_set_aside_for_its_receive(make_groups: MakeGroups) -> None:
    """Rank 0 sends, then posts a small all_reduce late; rank 1, waiting in the mailbox, finds the frame on its socket,
    sets it aside (no mismatch) and goes on waiting; its receive after the all_reduce takes it."""
    gs = make_groups(2, 10.0)
    run_on(gs, lambda pg: pg.barrier())  # mailbox up

    def body(pg: ProcessGroup) -> Any:
        x = np.full(3, pg.rank + 1.0)
        if pg.rank == 0:
            pg.send(np.arange(6.0), 1, tag=2)
            time.sleep(0.2)
            pg.all_reduce(x)
            return x
        pg.all_reduce(x)
        early = len(pg.backend.g.peers[0].early)  # type: ignore[union-attr]
        y = np.empty(6)
        pg.recv(y, 0, tag=2)
        return x, y, early
    x0, (x1, y, early) = run_on(gs, body)
    assert x0.tolist() == x1.tolist() == [3.0, 3.0, 3.0]
    assert early == 1 and y.tolist() == list(range(6))


def test_a_silent_peer_times_out_naming_it(make_groups: MakeGroups) -> None:
    gs = make_groups(3, 1.0)
    run_on(gs, lambda pg: pg.barrier())
    t0 = time.monotonic()
    errors = run_on(gs[:2], lambda pg: pg.all_reduce(np.ones(3)), return_exceptions=True)
    assert 0.9 < time.monotonic() - t0 < 3.0
    assert all(isinstance(e, DistributedError) for e in errors), errors
    assert any("timed out after 1.0 s waiting for peer 2" in str(e) for e in errors), errors


def _die_mid_stream(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Rank 1 kills itself after a few small all-reduces; the others keep going and must raise."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp", BackendOptions(timeout=5.0))
    all_reduce_until_killed(pg, np.ones(16, np.float32), 10_000, 100, q, lambda pg: mailbox_of(pg) is not None)


def test_a_killed_process_makes_the_others_raise_promptly() -> None:
    items, codes = collect_from_processes(_die_mid_stream, 3, expect=2)
    got = {r: (m, t, used) for r, m, t, used, _ in items}
    assert sorted(got) == [0, 2]
    for msg, took, used in got.values():
        assert "all_reduce" in msg and "rank 1" in msg and took < 2.0 and used, msg
    assert codes[1] == -signal.SIGKILL
    assert all(glob.glob(f"/dev/shm/axond-{pid}-*") == [] for *_, pid in items)
