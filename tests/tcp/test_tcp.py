"""TCP backend failure handling: mismatched calls, dead peers, timeouts, authentication, async ops.

Ranks are threads (or processes where a real death is needed) joined by loopback sockets; every
failure case must raise `DistributedError` on every rank within a couple of seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, InMemoryStore, ProcessGroup, ReduceOp
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions, policy
from axond.distributed.backends.addresses import interface_address
from axond.distributed.backends.tcp.transport.mesh import Mesh
from axond.distributed.backends.tcp.transport.wire import Op, group_id
from axond.testing import RankFailed, collect_from_processes, run_on, thread_groups
from axond.testing.waits import wait_until

SHORT = BackendOptions(timeout=1.0)
MakeGroups = Callable[..., list[ProcessGroup]]


def algorithm_of(pg: ProcessGroup, op: Op, options: TcpOptions | None = None) -> Callable[[int], str]:
    """The socket schedule `pg`'s backend picks for `op` by bytes per rank (see `policy.socket_algorithm`)."""
    b: Any = pg.backend
    return lambda n: policy.socket_algorithm(op, n, b.size, b.comm.oversubscribed, options or b.tcp_options)


@pytest.fixture(autouse=True, scope="module")
def sockets_only() -> Iterator[None]:
    """These tests are about the socket transport (as between hosts): no shared memory, even on one host.
    The shared-memory path has its own failure tests in test_shm.py."""
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("AXOND_SHM", "0")
        yield


@pytest.fixture
def pair() -> Iterator[list[ProcessGroup]]:
    gs = thread_groups(2, options=SHORT)
    yield gs
    for g in gs:
        g.destroy()


@pytest.fixture
def trio() -> Iterator[list[ProcessGroup]]:
    gs = thread_groups(3, options=SHORT)
    yield gs
    for g in gs:
        g.destroy()


def errors_of(results: list[Any]) -> list[str]:
    assert all(isinstance(r, DistributedError) for r in results), results
    return [str(r) for r in results]


def test_different_collective_raises_on_both_ranks_naming_both_sides(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        x = np.zeros(10, np.float32)
        if pg.rank == 0:
            pg.all_reduce(x)
        else:
            pg.broadcast(x, 0)

    t0 = time.monotonic()
    e0, e1 = errors_of(run_on(pair, body, return_exceptions=True))
    assert time.monotonic() - t0 < 2.0
    both = ("peer rank 0 called all_reduce with SUM (float32, 10 elements) but this rank called broadcast src=0 "
            "(float32, 10 elements)")
    assert e1 == f"broadcast on group 'world' (rank 1 of 2): {both}"
    # Rank 0 was waiting for rank 1's data and learns why rank 1 gave up.
    assert e0.startswith("all_reduce on group 'world' (rank 0 of 2): peer rank 1 ") and both in e0


@pytest.mark.parametrize("second", [(np.float64, 10, ReduceOp.SUM), (np.float32, 11, ReduceOp.SUM),
                                    (np.float32, 10, ReduceOp.MAX)])
def test_different_dtype_size_or_op_raises_on_both(pair: list[ProcessGroup], second: tuple[Any, int, ReduceOp]) -> None:
    dtype, n, op = second

    def body(pg: ProcessGroup) -> None:
        x = np.zeros(10, np.float32) if pg.rank == 0 else np.zeros(n, dtype)
        pg.all_reduce(x, ReduceOp.SUM if pg.rank == 0 else op)

    e0, e1 = errors_of(run_on(pair, body, return_exceptions=True))
    assert "but this rank called all_reduce" in e0 and "peer rank 1" in e0
    assert f"{np.dtype(dtype)}, {n} elements" in e0
    assert "peer rank 0 called all_reduce with SUM (float32, 10 elements)" in e1


def test_large_mismatch_does_not_corrupt_or_hang(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        pg.all_reduce(np.ones(1_000_000 + pg.rank, np.float32))

    errors_of(run_on(pair, body, return_exceptions=True))


def test_mismatch_in_three_ranks_reaches_every_rank(trio: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        x = np.ones(300_000, np.float32)
        if pg.rank == 2:
            pg.all_gather(x[:1000])
        else:
            pg.all_reduce(x)

    t0 = time.monotonic()
    msgs = errors_of(run_on(trio, body, return_exceptions=True))
    assert time.monotonic() - t0 < 2.0
    assert any("called all_gather" in m for m in msgs)


def test_group_is_unusable_after_a_failure(pair: list[ProcessGroup]) -> None:
    run_on(pair, lambda pg: pg.all_reduce(np.zeros(3, np.float32) if pg.rank else np.zeros(4, np.float32)),
           return_exceptions=True)
    with pytest.raises(DistributedError, match="aborted by an earlier failure"):
        pair[0].all_reduce(np.zeros(3, np.float32))


def test_broadcast_root_learns_of_mismatch_on_its_next_call(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        x = np.zeros(4, np.int32)
        if pg.rank == 0:
            pg.broadcast(x, 0)
            pg.barrier()
        else:
            pg.all_gather(x)

    e0, e1 = errors_of(run_on(pair, body, return_exceptions=True))
    assert "called all_gather" in e1
    assert "barrier" in e0 and "peer rank 1" in e0


def test_peer_that_leaves_makes_the_other_raise_fast(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        if pg.rank == 1:
            wait_until(lambda: pair[0].inflight == "all_reduce", 10.0, "rank 0 in all_reduce")
            pg.destroy()
            return
        pg.all_reduce(np.ones(5, np.float32))

    t0 = time.monotonic()
    out = run_on(pair, body, return_exceptions=True)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(out[0], DistributedError)
    assert "peer rank 1 closed the connection (did it die?)" in str(out[0])
    assert out[0].peer == 1 and out[0].op == "all_reduce" and out[0].group == "world"


def test_silent_peer_times_out(pair: list[ProcessGroup]) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"all_reduce on group 'world' \(rank 0 of 2\): timed out after 1.0 s "
                                               r"waiting for peer 1"):
        pair[0].all_reduce(np.ones(5, np.float32))
    assert 0.9 < time.monotonic() - t0 < 2.0
    # The late rank may still complete the op whose data rank 0 had already sent; its next one fails.
    with pytest.raises(DistributedError, match="peer rank 0 gave up: all_reduce .* timed out"):
        for _ in range(2):
            pair[1].all_reduce(np.ones(5, np.float32))


def _die_or_reduce(rank: int, size: int, store_dir: str, q: Any) -> None:
    pg = create_group(FileStore(store_dir), rank, size, "tcp", BackendOptions(timeout=5.0))
    pg.all_reduce(np.ones(4, np.float32))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        pg.all_reduce(np.ones(2_000_000, np.float32))
        q.put((rank, "no error", 0.0))
    except DistributedError as e:
        q.put((rank, str(e), time.monotonic() - t0))
    pg.destroy()


def test_killed_process_makes_every_other_rank_raise() -> None:
    items, codes = collect_from_processes(_die_or_reduce, 3, expect=2, timeout=30.0)
    got = {r: (m, t) for r, m, t in items}
    assert sorted(got) == [0, 2]
    for rank, (msg, took) in got.items():
        assert "DistributedError" not in msg and "rank 1" in msg, msg
        assert took < 2.0
    assert codes[1] == -signal.SIGKILL


def test_wrong_secret_is_refused_on_both_sides() -> None:
    store = InMemoryStore()
    out: list[Any] = [None, None]

    def make(rank: int) -> None:
        try:
            out[rank] = create_group(store, rank, 2, "tcp", BackendOptions(timeout=1.5, job_secret=bytes([rank]) * 16))
        except DistributedError as e:
            out[rank] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(isinstance(o, DistributedError) for o in out), out
    assert "could not prove the job secret" in str(out[1])
    assert "timed out" in str(out[0]) and "[1]" in str(out[0])


def test_intruder_is_refused_and_the_group_still_forms() -> None:
    store = InMemoryStore()
    secret = b"s3cret"
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = create_group(store, rank, 2, "tcp", BackendOptions(timeout=5.0, job_secret=secret))

    t0 = threading.Thread(target=make, args=(0,))
    t0.start()
    host, _, port = store.get("pg/world/addr/0", 5.0).decode().rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2) as junk:
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
    intruder = Mesh(InMemoryStore(), 1, 2, group_id("world"), b"guess", None, 0, 2.0, "intruder")
    with pytest.raises(DistributedError, match="could not prove the job secret"):
        intruder._connect_to(0, host, int(port), time.monotonic() + 2.0)
    t1 = threading.Thread(target=make, args=(1,))
    t1.start()
    t0.join(10)
    t1.join(10)
    assert all(isinstance(g, ProcessGroup) for g in groups)
    try:
        out = run_on(groups, lambda pg: (pg.all_reduce(x := np.full(3, pg.rank + 1.0)), x)[1])
        assert all((x == 3).all() for x in out)
    finally:
        for g in groups:
            g.destroy()


def test_many_small_chunks_and_uneven_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_TCP_CHUNK_BYTES", "1000")
    monkeypatch.setenv("AXOND_TCP_SMALL_BYTES", "64")
    gs = thread_groups(3, options=BackendOptions(timeout=10.0))
    try:
        for count in (1, 2, 3, 101, 10_007):
            inputs = [np.random.default_rng(r).integers(-5, 5, count).astype(np.int64) for r in range(3)]
            out = run_on(gs, lambda pg: (pg.all_reduce(x := inputs[pg.rank].copy()), x)[1])
            for x in out:
                np.testing.assert_array_equal(x, np.sum(inputs, axis=0))
            out = run_on(gs, lambda pg: (pg.broadcast(x := inputs[pg.rank].copy(), 2), x)[1])
            for x in out:
                np.testing.assert_array_equal(x, inputs[2])
            out = run_on(gs, lambda pg: pg.all_gather(inputs[pg.rank]))
            for x in out:
                np.testing.assert_array_equal(x, np.stack(inputs))
            out = run_on(gs, lambda pg: pg.reduce_scatter(np.tile(inputs[pg.rank], 3)))
            for x in out:
                np.testing.assert_array_equal(x, np.sum(inputs, axis=0))
        # Above DIRECT_ALL_GATHER_BYTES all_gather goes around the ring (the own block is posted first).
        big = [np.full(200_003, r, np.float64) for r in range(3)]
        for x in run_on(gs, lambda pg: pg.all_gather(big[pg.rank])):
            np.testing.assert_array_equal(x, np.stack(big))
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("n", [2, 4])
def test_halving_doubling_all_reduce(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setenv("AXOND_TCP_ALGORITHM", "halving_doubling")
    monkeypatch.setenv("AXOND_TCP_CHUNK_BYTES", "4096")
    gs = thread_groups(n, options=BackendOptions(timeout=10.0))
    try:
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN):
            for count in (40_000, 100_003):
                inputs = [np.random.default_rng(r).integers(-9, 9, count).astype(np.float64) for r in range(n)]
                out = run_on(gs, lambda pg: (pg.all_reduce(x := inputs[pg.rank].copy(), op), x)[1])
                total = np.sum(inputs, axis=0)
                expected = {ReduceOp.SUM: total, ReduceOp.AVG: total / n, ReduceOp.MIN: np.min(inputs, axis=0)}[op]
                for x in out:
                    np.testing.assert_array_equal(x, expected)
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("crowded", [True, False])
def test_auto_all_reduce_algorithm_follows_the_cores(crowded: bool, make_groups: MakeGroups) -> None:
    """auto: on power-of-two groups with more ranks than cores, pairwise algorithms up to 2 MiB, then the ring."""
    gs = make_groups(4, 10.0, crowded=crowded)
    pick = algorithm_of(gs[0], Op.ALL_REDUCE)
    expected = {64 << 10: "doubling", 200 << 10: "doubling" if crowded else "ring",
                1 << 20: "halving_doubling" if crowded else "ring", 8 << 20: "ring"}
    assert {size: pick(size) for size in expected} == expected
    # Every path gives the reference sum (float64 integers: exact whatever the order of the adds).
    for count in (25_000, 131_075, 300_001):  # 200 KiB, 1 MiB (odd), 2.3 MiB
        inputs = [np.random.default_rng(r).integers(-9, 9, count).astype(np.float64) for r in range(4)]
        out = run_on(gs, lambda pg: (pg.all_reduce(x := inputs[pg.rank].copy(), ReduceOp.AVG), x)[1])
        for x in out:
            np.testing.assert_array_equal(x, np.sum(inputs, axis=0) / 4)


def test_two_ranks_move_up_to_1_mib_in_one_round(make_groups: MakeGroups) -> None:
    """With two ranks there is one hop and nothing to pipeline: all_reduce, broadcast and reduce_scatter up to
    1 MiB go as one frame each way (unless AXOND_TCP_ALGORITHM pins the all_reduce); the results are exact."""
    gs = make_groups(2, 10.0)
    assert [algorithm_of(gs[0], Op.ALL_REDUCE)(n) for n in (1 << 20, (1 << 20) + 8)] == ["doubling", "ring"]
    assert [algorithm_of(gs[0], Op.REDUCE_SCATTER)(n) for n in (1 << 20, (1 << 20) + 16)] == ["direct", "ring"]
    assert [algorithm_of(gs[0], Op.BROADCAST)(n) for n in (1 << 20, (1 << 20) + 1)] == ["tree", "chain"]
    assert algorithm_of(gs[0], Op.ALL_REDUCE, TcpOptions(algorithm="ring"))(1 << 20) == "ring"
    for count in (131_071, 131_072, 131_073):  # just under, at and over 1 MiB of float64
        inputs = [np.random.default_rng(r).integers(-9, 9, 2 * count).astype(np.float64) for r in range(2)]

        def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            x = inputs[pg.rank][:count].copy()
            pg.all_reduce(x, ReduceOp.AVG)
            b = inputs[pg.rank][:count].copy()
            pg.broadcast(b, 1)
            return x, b, pg.reduce_scatter(inputs[pg.rank][: 2 * (count // 2)])

        for r, (x, b, block) in enumerate(run_on(gs, body)):
            np.testing.assert_array_equal(x, (inputs[0][:count] + inputs[1][:count]) / 2)
            np.testing.assert_array_equal(b, inputs[1][:count])
            half = count // 2
            np.testing.assert_array_equal(block, (inputs[0] + inputs[1])[r * half : (r + 1) * half])


@pytest.mark.parametrize("crowded", [False, True])
def test_broadcast_uses_the_tree_longer_when_the_cores_are_crowded(crowded: bool, make_groups: MakeGroups) -> None:
    """Tree up to 128 KiB, or 4 MiB with more ranks than cores; then the chain. Both give the root's array."""
    gs = make_groups(3, 10.0, crowded=crowded)
    pick: Any = lambda n: algorithm_of(gs[0], Op.BROADCAST)(n) == "tree"  # noqa: E731
    assert [pick(n) for n in (128 << 10, 1 << 20, 4 << 20, (4 << 20) + 8)] == [True, crowded, crowded, False]
    for count in (131_071, 524_289):  # 1 and 4 MiB of float64 (odd lengths): each path once or twice
        data = [np.random.default_rng(r).standard_normal(count) for r in range(3)]
        for got in run_on(gs, lambda pg: (pg.broadcast(x := data[pg.rank].copy(), 2), x)[1]):
            np.testing.assert_array_equal(got, data[2])


@pytest.mark.parametrize("crowded", [False, True])
def test_all_gather_algorithm_follows_the_size_and_cores(crowded: bool, make_groups: MakeGroups) -> None:
    """Direct up to 4 MiB; above, recursive doubling on a crowded power-of-two group, else the ring."""
    gs = make_groups(4, 10.0, crowded=crowded)
    per_rank = algorithm_of(gs[0], Op.ALL_GATHER)
    pick = lambda n: "direct" if per_rank(n // 4) == "exchange" else per_rank(n // 4)  # noqa: E731  # n: the output
    big = "doubling" if crowded else "ring"
    assert [pick(n) for n in (1 << 10, 4 << 20, (4 << 20) + 8, 64 << 20)] == ["direct", "direct", big, big]
    for count in (262_147, 1_000_003):  # 4.0 and 15.3 MiB of float32 output, odd lengths
        inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(4)]
        for got in run_on(gs, lambda pg: pg.all_gather(inputs[pg.rank])):
            np.testing.assert_array_equal(got, np.stack(inputs))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("crowded", [False, True])
def test_reduce_scatter_algorithm_follows_the_size_and_cores(crowded: bool, size: int, make_groups: MakeGroups) -> None:
    """Direct up to 128 KiB (1 MiB with two ranks); recursive halving up to 2 MiB on a crowded power-of-two
    group; else the ring. Every path gives the reference blocks and leaves the input untouched."""
    gs = make_groups(size, 10.0, crowded=crowded)
    pick = algorithm_of(gs[0], Op.REDUCE_SCATTER)
    mid = "halving" if crowded else "ring"
    one_mib = "direct" if size == 2 else mid
    assert [pick(n) for n in (128 << 10, 1 << 20, 2 << 20, 4 << 20)] == ["direct", one_mib, mid, "ring"]
    for count in (size * 20_011, size * 131_072, size * 300_007):  # 0.3-0.6, 2 and 4.6-9.2 MiB of float64
        inputs = [np.random.default_rng(r).integers(-9, 9, count).astype(np.float64) for r in range(size)]
        for op, ref in ((ReduceOp.SUM, np.sum(inputs, 0)), (ReduceOp.AVG, np.sum(inputs, 0) / size),
                        (ReduceOp.MAX, np.max(inputs, 0))):
            got = run_on(gs, lambda pg: (pg.reduce_scatter(x := inputs[pg.rank].copy(), op), x))
            per = count // size
            for r, (block, x) in enumerate(got):
                np.testing.assert_array_equal(block, ref[r * per : (r + 1) * per])
                np.testing.assert_array_equal(x, inputs[r])


def test_unknown_algorithm_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_TCP_ALGORITHM", "tree")
    with pytest.raises(ValueError, match="AXOND_TCP_ALGORITHM='tree': use auto, ring or halving_doubling"):
        TcpOptions.from_env()


def test_async_ops_complete_in_order_and_overlap(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> list[np.ndarray]:
        xs = [np.full(200_000 if i % 2 else 3, float(pg.rank + i), np.float32) for i in range(6)]
        works = [pg.all_reduce(x, ReduceOp.SUM, async_op=True) for x in xs]
        gathered = pg.all_gather(np.array([pg.rank]), async_op=True)
        assert works[-1] is not None and works[-1].wait(timeout=5.0)
        assert all(w is not None and w.is_completed() for w in works)
        assert (gathered.result() == [[0], [1]]).all()
        return xs

    for xs in run_on(pair, body):
        for i, x in enumerate(xs):
            assert (x == 1 + 2 * i).all()


def test_isend_irecv_out_of_step_large(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> np.ndarray:
        out = np.full(4_000_000, pg.rank, np.float32)
        into = np.empty_like(out)
        other = 1 - pg.rank
        if pg.rank == 0:
            works = [pg.irecv(into, other), pg.isend(out, other)]
        else:
            works = [pg.isend(out, other), pg.irecv(into, other)]
        for w in works:
            w.wait()
        return into

    a, b = run_on(pair, body)
    assert (a == 1).all() and (b == 0).all()


def test_isend_first_on_both_sides_then_recv(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> tuple[bool, np.ndarray]:
        out = np.full(6_000_000, pg.rank + 1, np.float32)
        into = np.empty_like(out)
        sending = pg.isend(out, 1 - pg.rank)
        pg.recv(into, 1 - pg.rank)
        return sending.wait(timeout=5.0), into

    (ok0, a), (ok1, b) = run_on(pair, body)
    assert ok0 and ok1 and (a == 2).all() and (b == 1).all()


def test_small_all_reduce_behind_a_queued_isend_keeps_order_and_values(pair: list[ProcessGroup]) -> None:
    """A latency-path all-reduce while a large isend to the same peer is still leaving: its frame goes after."""
    def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray | None]:
        big = np.full(3_000_000, 7.0, np.float32)
        x = np.array([pg.rank + 1.0, 10.0 * (pg.rank + 1)], np.float64)
        if pg.rank == 0:
            work = pg.isend(big, 1)
            pg.all_reduce(x)
            assert work is not None
            work.wait()
            return x, None
        into = np.empty_like(big)
        pg.recv(into, 0)
        pg.all_reduce(x)
        return x, into

    (x0, _), (x1, into) = run_on(pair, body)
    assert x0.tolist() == x1.tolist() == [3.0, 30.0]
    assert into is not None and (into == 7.0).all()


def test_work_wait_reraises_the_failure(pair: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> None:
        work = pg.all_reduce(np.zeros(5 + pg.rank, np.float32), async_op=True)
        assert work is not None
        work.wait()

    errors_of(run_on(pair, body, return_exceptions=True))


def test_subgroups_used_concurrently_with_the_default_group() -> None:
    gs = thread_groups(4, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> tuple[float, float]:
            sub = pg.new_group([0, 2])
            other = pg.new_group([1, 3])
            mine = sub if sub.contains(pg.global_rank) else other
            side = np.zeros(100_001, np.float64)

            def on_sub() -> None:
                for _ in range(20):
                    side[...] = pg.rank
                    mine.all_reduce(side)

            t = threading.Thread(target=on_sub)
            t.start()
            x = np.zeros(1000, np.float64)
            for _ in range(20):
                x[...] = pg.rank
                pg.all_reduce(x)
            t.join(20)
            sub.destroy()
            other.destroy()
            return float(x[0]), float(side[0])

        out = run_on(gs, body)
        assert out == [(6.0, 2.0), (6.0, 4.0), (6.0, 2.0), (6.0, 4.0)]
    finally:
        for g in gs:
            g.destroy()


def test_socket_interface_choice() -> None:
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(DistributedError, match="AXOND_SOCKET_IFNAME='nope0'"):
        interface_address("nope0")


def test_non_numpy_input_gets_a_clear_error(pair: list[ProcessGroup]) -> None:
    with pytest.raises(TypeError, match="must be a NumPy array"):
        pair[0].all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="src=5 is not a rank"):
        pair[0].broadcast(np.zeros(1), 5)


def test_run_threads_reports_the_failing_rank() -> None:
    from axond.testing import run_threads

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 1:
            raise ValueError("boom on one")
        pg.barrier()

    with pytest.raises(RankFailed, match="rank 1 of 2 failed: boom on one") as info:
        run_threads(body, 2, timeout=10.0, options=SHORT)
    assert "Traceback" in str(info.value)


@pytest.mark.parametrize("world", [3, 4, 5])
def test_ring_reduce_scatter_reuses_two_blocks_of_scratch(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large reduce_scatter with small pipeline chunks: partial sums go through two block-sized scratch halves
    used in turn (a half is rewritten only after the sends reading it left), never a copy of the input."""
    monkeypatch.setenv("AXOND_TCP_CHUNK_BYTES", "4096")
    rows = 7_001  # world * rows * 8 bytes > 128 KiB: the ring, not the direct algorithm
    groups = thread_groups(world, options=BackendOptions(timeout=20.0))
    try:
        inputs = [np.random.default_rng(r).standard_normal(world * rows) for r in range(world)]
        want = np.sum(inputs, axis=0)
        for _ in range(2):
            outs = run_on(groups, lambda pg: pg.reduce_scatter(inputs[pg.rank], ReduceOp.SUM))
            for r, got in enumerate(outs):
                np.testing.assert_allclose(got, want[r * rows : (r + 1) * rows], rtol=1e-12, atol=1e-12)
        for pg in groups:
            bufs = pg.backend.comm.scratch.named_buffers  # type: ignore[union-attr]
            assert "work" not in bufs and bufs["rolling"].nbytes == 2 * rows * 8
    finally:
        for g in groups:
            g.destroy()


def test_sent_arrays_are_not_kept_alive_by_the_transport(pair: list[ProcessGroup]) -> None:
    """After a large send completes, nothing in the transport (an idle sender thread) references the array:
    FSDP frees its full gradient right after reduce-scattering it and relies on that."""
    import gc
    import weakref

    def body(pg: ProcessGroup) -> bool:
        if pg.rank == 0:
            big = np.ones(1 << 20)  # 8 MiB: goes through the peer's sender thread
            ref = weakref.ref(big)
            pg.send(big, 1)
            pg.barrier()
            del big
            gc.collect()
            return ref() is None
        out = np.empty(1 << 20)
        pg.recv(out, 0)
        pg.barrier()
        return bool(out.min() == 1.0)

    gc.freeze()  # the collection then scans only what the test made (the test process's heap can be large)
    try:
        assert run_on(pair, body) == [True, True]
    finally:
        gc.unfreeze()


def test_async_ops_do_not_keep_their_arrays_alive(pair: list[ProcessGroup]) -> None:
    """Once an async op finished, the group's idle communication thread holds no reference to its arrays."""
    import gc
    import weakref

    def body(pg: ProcessGroup) -> bool:
        x = np.ones(1 << 16)
        out = np.empty((2, 1 << 16))
        refs = [weakref.ref(a) for a in (x, out)]
        works = [pg.all_reduce(x, async_op=True), pg.all_gather(x, async_op=True, out=out)]
        assert all(w is not None and w.wait() for w in works)
        del x, out, works
        gc.collect()
        return all(r() is None for r in refs)

    gc.freeze()  # as above
    try:
        assert run_on(pair, body) == [True, True]
    finally:
        gc.unfreeze()
