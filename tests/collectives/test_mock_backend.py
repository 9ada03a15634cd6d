"""The mock backend's own promises: no socket, tcp's numbers bit for bit, and tcp's error paths, deterministically.

Its collectives are checked against NumPy by the contract suite (test_collectives, transport "mock"); here: that
`run_threads(..., backend="mock")` creates no socket (socket creation is made to fail, which breaks tcp), that
float results equal tcp's (shared-memory paths) byte for byte, that mismatched calls, missing and departed
members raise `DistributedError` on every member naming op, group and peer, and the single-rank helpers.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

import axond
from axond import DistributedError, InMemoryStore, ProcessGroup, ReduceOp, World
from axond.distributed import BackendOptions, create_group
from axond.testing import RankFailed, run_on, run_threads, thread_groups
from axond.testing.waits import wait_until


def _every_op(pg: ProcessGroup) -> list[Any]:
    """One call of each kind (sync and async, p2p and batched p2p, subgroups, objects): what code under test may do."""
    n, r = pg.size, pg.rank
    x = np.full(5, r + 1.0)
    pg.all_reduce(x)
    b = np.full(3, r, np.int32)
    pg.broadcast(b, n - 1)
    red = np.full(2, r + 1, np.int64)
    pg.reduce(red, 0, ReduceOp.MAX)
    gathered = pg.all_gather(np.array([r]))
    block = pg.reduce_scatter(np.ones(2 * n, np.float32))
    at_root = pg.gather(np.array([r * 2]), 1)
    part = pg.scatter(np.arange(n * 2).reshape(n, 2) if r == 0 else None, 0)
    swapped = pg.all_to_all(np.arange(n) + 10 * r)
    uneven = pg.all_to_all(np.full(r, r), input_split_sizes=[r if d == (r + 1) % n else 0 for d in range(n)])
    work = pg.isend(np.full(4, r, np.int16), (r + 1) % n, tag=9)
    got = np.empty(4, np.int16)
    pg.irecv(got, (r - 1) % n, tag=9).wait()
    work.wait()
    into = np.empty(2, np.int64)
    batch = [axond.P2POp(axond.irecv, into, (r - 1) % n, pg, tag=1),
             axond.P2POp(axond.isend, np.full(2, r, np.int64), (r + 1) % n, pg, tag=1)]
    for w in axond.batch_isend_irecv(batch):
        w.wait()
    assert (into == (r - 1) % n).all()
    pair = pg.new_group([0, 1])
    if pair.backend is not None:
        one = np.ones(1)
        pair.all_reduce(one)
        assert one[0] == 2
    pair.destroy()
    objs: list[Any] = [None] * n
    axond.all_gather_object(objs, {"rank": r}, group=pg)
    pg.barrier()
    pg.monitored_barrier()
    pg.all_reduce(np.zeros(1), async_op=True).wait()
    return [x, b, red, gathered, block, at_root, part, swapped, uneven, got, objs]


def test_run_threads_on_mock_creates_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a socket was created")

    monkeypatch.setattr(socket.socket, "__init__", refuse)
    out = run_threads(_every_op, 3, backend="mock", timeout=20.0)
    assert [o[0][0] for o in out] == [6.0] * 3
    assert [o[1][0] for o in out] == [2] * 3 and out[0][2][0] == 3
    assert (out[1][5].ravel() == [0, 2, 4]).all() and out[0][5] is None
    assert [list(o[6]) for o in out] == [[0, 1], [2, 3], [4, 5]]
    assert list(out[1][7]) == [1, 11, 21] and list(out[2][8]) == [1] and len(out[0][8]) == 2
    assert [int(o[9][0]) for o in out] == [2, 0, 1]
    assert out[2][10] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    with pytest.raises(RankFailed, match="a socket was created"):  # the check bites: tcp cannot form a group
        run_threads(_every_op, 2, backend="tcp", timeout=10.0)


def _random_ops(pg: ProcessGroup) -> list[bytes]:
    """Float reductions of random data in every ReduceOp, small and large, as bytes."""
    out = []
    for size in (7, 50_001):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX):
            x = np.random.default_rng([pg.rank, size]).standard_normal(size * pg.size).astype(np.float32)
            y = x.copy()
            pg.all_reduce(y, op)
            z = x.copy()
            pg.reduce(z, 1, op)
            rs = pg.reduce_scatter(x, op)
            out += [y.tobytes(), z.tobytes() if pg.rank == 1 else b"", rs.tobytes()]
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_float_results_equal_tcp_bit_for_bit(make_groups: Any, n: int) -> None:
    """In rank order as tcp's shared-memory paths (all_reduce, reduce_scatter), in tcp's tree order (reduce)."""
    tcp = run_on(make_groups(n, 20.0, transport="spin"), _random_ops)
    mock = run_on(make_groups(n, 20.0, transport="mock"), _random_ops)
    again = run_threads(_random_ops, n, backend="mock")
    assert mock == tcp
    assert again == mock
    assert len({rows[0] for rows in mock}) == 1  # and every member got the same all_reduce


@pytest.mark.parametrize("calls", [
    ("all_reduce float32 4", "broadcast float32 4"),
    ("all_reduce float32 4", "all_reduce float64 4"),
    ("all_reduce float32 4", "all_reduce float32 5"),
    ("all_reduce float32 4", "all_reduce_max float32 4"),
    ("broadcast float32 4", "broadcast_1 float32 4"),
    ("all_to_all float32 4", "all_to_all_uneven float32 4"),
], ids=["op", "dtype", "count", "reduce-op", "root", "split-sizes"])
def test_a_mismatched_collective_raises_on_every_member_naming_the_peer(calls: tuple[str, str]) -> None:
    gs = thread_groups(3, backend="mock", options=BackendOptions(timeout=10.0))

    def body(pg: ProcessGroup) -> None:
        kind, dtype, count = calls[pg.rank == 2].split()
        x = np.zeros(int(count), dtype)
        if kind.startswith("all_reduce"):
            pg.all_reduce(x, ReduceOp.MAX if kind.endswith("max") else ReduceOp.SUM)
        elif kind.startswith("broadcast"):
            pg.broadcast(x, 1 if kind.endswith("1") else 0)
        elif kind == "all_to_all_uneven":
            pg.all_to_all(np.zeros(3, dtype), input_split_sizes=[1, 1, 1])
        else:
            pg.all_to_all(np.zeros(3, dtype))

    t0 = time.monotonic()
    errors = run_on(gs, body, return_exceptions=True)
    assert time.monotonic() - t0 < 5.0
    for r, e in enumerate(errors):
        assert isinstance(e, DistributedError), errors
        assert (e.group, e.rank, e.peer) == ("world", r, 0 if r == 2 else 2)
        assert e.op in str(e) and "group 'world'" in str(e) and f"peer rank {e.peer} called" in str(e)
    with pytest.raises(DistributedError, match="aborted by an earlier failure"):
        gs[0].barrier()

    def message(pg: ProcessGroup) -> str:
        try:
            body(pg)
        except DistributedError as e:
            return str(e)
        return "no error"

    assert run_threads(message, 3, backend="mock") == [str(e) for e in errors]  # the same messages every run
    for g in gs:
        g.destroy()


def test_split_sizes_that_disagree_raise_on_both_sides() -> None:
    def body(pg: ProcessGroup) -> Any:
        sends = [1, 2] if pg.rank == 0 else [1, 1]  # rank 0 sends 2 rows to rank 1, which expects 1
        return pg.all_to_all(np.zeros(sum(sends)), input_split_sizes=sends, output_split_sizes=[1, 1])

    errors = run_on(thread_groups(2, backend="mock"), body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "disagree on the split sizes" in str(e) for e in errors), errors
    assert [e.peer for e in errors] == [1, 0]


def test_a_member_that_never_arrives_times_out_the_others_and_says_what_it_does() -> None:
    gs = thread_groups(3, backend="mock", options=BackendOptions(timeout=1.0))
    gave_up = {0: threading.Event(), 2: threading.Event()}

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 1:  # never in time: arrives once the others have given up
            for done in gave_up.values():
                assert done.wait(30.0), "the others never gave up"
            pg.all_reduce(np.ones(2))
            return
        try:
            pg.all_reduce(np.ones(2))
        finally:
            gave_up[pg.rank].set()

    t0 = time.monotonic()
    errors = run_on(gs, body, return_exceptions=True)
    assert 1.0 <= time.monotonic() - t0 < 6.0
    for r in (0, 2):
        e = errors[r]
        assert isinstance(e, DistributedError) and e.peer == 1 and e.op == "all_reduce", errors
        assert "timed out after 1.0 s waiting for peer 1; peer rank 1 has not called an op" in str(e)
    late = errors[1]
    assert isinstance(late, DistributedError) and "gave up" in str(late) and "timed out" in str(late)
    for g in gs:
        g.destroy()


def test_a_deadlock_names_what_the_peer_is_blocked_in() -> None:
    def body(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.all_reduce(np.ones(1))
        else:
            time.sleep(0.3)  # so that rank 0 times out first (rank 1 then raises that it gave up)
            pg.recv(np.empty(1), 0, tag=3)

    errors = run_on(thread_groups(2, backend="mock", options=BackendOptions(timeout=1.0)), body,
                    return_exceptions=True)
    assert isinstance(errors[0], DistributedError) and "peer rank 1 is in recv from rank 0 (tag=3)" in str(errors[0])
    assert isinstance(errors[1], DistributedError) and errors[1].op == "recv" and "gave up" in str(errors[1]), errors


def test_a_cross_group_deadlock_names_the_group_the_peer_is_blocked_in() -> None:
    """As on tcp (test_inflight): the peer in no op of this group is described by what it reports elsewhere."""
    pair = thread_groups(2, backend="mock", options=BackendOptions(timeout=1.2))
    subs = run_on(pair, lambda g: g.new_group([0, 1]))

    def body(g: ProcessGroup) -> None:
        if g.rank == 0:
            g.all_reduce(np.ones(4, np.float32))
        else:
            time.sleep(0.3)  # enter later, so that rank 0 times out first, while rank 1 still waits
            subs[1].broadcast(np.ones(4, np.float32), 0)

    out = run_on(pair, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert "all_reduce on group 'world' (rank 0 of 2): timed out after 1.2 s waiting for peer 1; " in str(out[0])
    assert f"is blocked in broadcast on group '{subs[1].name}' for " in str(out[0])
    assert "not in all_reduce on group 'world': the ranks issued their ops in different orders" in str(out[0])
    assert f"broadcast on group '{subs[1].name}' (rank 1 of 2): timed out after 1.2 s waiting for peer 0" in str(out[1])
    for g in subs + pair:
        g.destroy()


def test_abort_and_destroy_release_waiting_members_at_once() -> None:
    gs = thread_groups(3, backend="mock", options=BackendOptions(timeout=20.0))

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            wait_until(lambda: all(g.inflight == "all_reduce" for g in gs[1:]), 10.0, "the others in all_reduce")
            pg.abort("stage 0 hit a NaN")
            return
        pg.all_reduce(np.ones(3))

    t0 = time.monotonic()
    errors = run_on(gs, body, return_exceptions=True)
    assert time.monotonic() - t0 < 5.0
    for e in errors[1:]:
        assert isinstance(e, DistributedError) and e.peer == 0 and "gave up: stage 0 hit a NaN" in str(e), errors
    for g in gs:
        g.destroy()
    with pytest.raises(DistributedError, match="destroyed"):
        gs[1].all_reduce(np.ones(1))

    trio = thread_groups(3, backend="mock", options=BackendOptions(timeout=20.0))

    def leave_or_wait(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            wait_until(lambda: trio[1].inflight == "recv" and trio[2].inflight == "all_reduce", 10.0,
                       "the others in their ops")
            pg.destroy()
        elif pg.rank == 1:
            pg.recv(np.empty(2), 0)
        else:
            pg.all_reduce(np.ones(2))

    t0 = time.monotonic()
    errors = run_on(trio, leave_or_wait, return_exceptions=True)
    assert time.monotonic() - t0 < 5.0
    for e in errors[1:]:  # the departure, not the abort that the first to see it then made
        assert isinstance(e, DistributedError) and e.peer == 0 and "peer rank 0 left the group" in str(e), errors
    for g in trio:
        g.destroy()


def test_an_async_op_carries_its_mismatch_in_its_work() -> None:
    def body(pg: ProcessGroup) -> None:
        pg.all_reduce(np.ones(2 + pg.rank), async_op=True).wait()

    errors = run_on(thread_groups(2, backend="mock"), body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and e.op == "all_reduce" for e in errors), errors


def test_run_threads_reraises_the_first_failure_with_its_rank() -> None:
    def body(pg: ProcessGroup) -> int:
        if pg.rank == 2:
            raise ValueError("bad shard on rank 2")
        pg.all_reduce(np.ones(1))  # released when rank 2 leaves, long before the 30 s timeout
        return pg.rank

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 of 3 failed: bad shard on rank 2") as info:
        run_threads(body, 3, backend="mock")
    assert info.value.rank == 2 and isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - t0 < 10.0
    assert run_threads(lambda pg: pg.rank * 10, 4, backend="mock") == [0, 10, 20, 30]


def test_single_rank_group_and_world_for_unit_tests() -> None:
    pg = ProcessGroup.mock()
    assert (pg.rank, pg.size, pg.backend_name) == (0, 1, "mock")
    x = np.arange(4.0)
    pg.all_reduce(x, ReduceOp.AVG)
    assert list(x) == [0.0, 1.0, 2.0, 3.0]
    assert pg.all_gather(x).shape == (1, 4) and list(pg.reduce_scatter(x)) == list(x)
    assert list(pg.scatter(np.array([[7, 8]]), 0)) == [7, 8] and pg.gather(x).shape == (1, 4)
    assert pg.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
    sub = pg.new_group([0])
    assert sub.backend_name == "mock" and sub.size == 1
    with pytest.raises(ValueError, match="cannot send to itself"):
        pg.send(x, 0)
    pg.destroy()

    world = World.mock()
    assert (world.rank(), world.world_size()) == (0, 1)
    g = world.default_group()
    assert list(axond.all_reduce_mean(np.array([3.0, 5.0]), g)) == [3.0, 5.0] and axond.is_main_process(g)
    assert World.mock().default_group() is not g  # a fresh world each time
    g.destroy()


def test_module_functions_on_a_mock_default_group() -> None:
    axond.init_process_group("mock", rank=0, world_size=1, store=InMemoryStore())
    try:
        x = np.ones(3)
        axond.all_reduce(x)
        assert axond.get_world_size() == 1 and axond.get_backend() == "mock" and list(x) == [1.0] * 3
    finally:
        axond.destroy_process_group()


def test_members_in_different_processes_are_refused_clearly() -> None:
    store = InMemoryStore()
    store.set("pg/world/mock/hub/0", b"1:1")  # as if rank 0 (process 1) had published its hub
    with pytest.raises(DistributedError, match="joins threads of one process only; use backend='tcp'"):
        create_group(store, 1, 2, "mock", BackendOptions(timeout=1.0))
