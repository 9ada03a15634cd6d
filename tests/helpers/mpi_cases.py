"""The collective contract cases run by every rank of an MPI job: `mpirun -n N python mpi_cases.py BACKEND OUT`.

Ranks of an MPI job are processes, not the threads of tests/collectives/test_collectives.py, so this script runs the
same inputs and NumPy references (`collective_cases`) on its own rank and checks its own results; rank 0 writes every
rank's failures to OUT as JSON ({"size", "backend", "cases", "hosts", "failures": [[rank, case, message]]}), which
tests/collectives/test_mpi_backend.py asserts empty. The group is formed without any rendezvous set: through MPI
(`axond.store.mpi_rendezvous`), as a plain `mpirun` job does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import axond
from axond import DistributedError, ProcessGroup
from axond.distributed.backends.mpi.plans import STREAM_BYTES
from collective_cases import ARITHMETIC, BITWISE_UFUNCS, DTYPES, LOW_PRECISION, SHAPES, make, reference, refused

CASES: list[Callable[[ProcessGroup], None]] = []


def case(fn: Callable[[ProcessGroup], None]) -> Callable[[ProcessGroup], None]:
    CASES.append(fn)
    return fn


def inputs(n: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[np.ndarray]:
    return [make(r, shape, dtype, seed) for r in range(n)]


def same(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, got.dtype, expected.shape)
    np.testing.assert_array_equal(got, expected, err_msg=what)


@case
def all_reduce_every_op_dtype_and_shape(pg: ProcessGroup) -> None:
    for dtype in DTYPES + LOW_PRECISION:
        for op in ARITHMETIC:
            if refused(dtype, op):
                continue
            for shape in SHAPES:
                xs = inputs(pg.size, shape, dtype)
                x = xs[pg.rank].copy()
                pg.all_reduce(x, op)
                same(x, reference(xs, op), f"all_reduce {op} {dtype} {shape}")


@case
def bitwise_all_reduce(pg: ProcessGroup) -> None:
    for dtype in ("int8", "int64", "uint8", "bool"):
        for op in BITWISE_UFUNCS:
            for shape in [(), (13,), (40_009,)]:
                xs = inputs(pg.size, shape, dtype, seed=7)
                x = xs[pg.rank].copy()
                pg.all_reduce(x, op)
                same(x, reference(xs, op), f"all_reduce {op} {dtype} {shape}")


@case
def non_contiguous_all_reduce_in_place(pg: ProcessGroup) -> None:
    base = np.arange(40, dtype=np.float64).reshape(8, 5) * (pg.rank + 1)
    view = base[::2, 1:4]
    pg.all_reduce(view)
    total = pg.size * (pg.size + 1) / 2
    np.testing.assert_array_equal(view, np.arange(40.0).reshape(8, 5)[::2, 1:4] * total)
    np.testing.assert_array_equal(base[1::2], np.arange(40.0).reshape(8, 5)[1::2] * (pg.rank + 1))


@case
def broadcast_every_dtype_and_root(pg: ProcessGroup) -> None:
    for dtype in DTYPES + LOW_PRECISION:
        for src in range(pg.size):
            for shape in SHAPES:
                xs = inputs(pg.size, shape, dtype, seed=src)
                x = xs[pg.rank].copy()
                pg.broadcast(x, src)
                same(x, xs[src], f"broadcast {dtype} {shape} src={src}")


@case
def reduce_to_each_root(pg: ProcessGroup) -> None:
    for dtype in ("float32", "int32", "bfloat16", "float16"):
        for op in ARITHMETIC:
            if refused(dtype, op):
                continue
            for dst in range(pg.size):
                xs = inputs(pg.size, (1031,), dtype)
                x = xs[pg.rank].copy()
                pg.reduce(x, dst, op)
                if pg.rank == dst:
                    same(x, reference(xs, op), f"reduce {op} {dtype} dst={dst}")


@case
def all_gather_every_dtype(pg: ProcessGroup) -> None:
    for dtype in DTYPES + LOW_PRECISION:
        for shape in SHAPES:
            xs = inputs(pg.size, shape, dtype)
            same(pg.all_gather(xs[pg.rank]), np.stack(xs), f"all_gather {dtype} {shape}")
    out = np.empty((pg.size, 3), np.int64)
    assert pg.all_gather(np.full(3, pg.rank, np.int64), out=out) is out
    same(out, np.repeat(np.arange(pg.size)[:, None], 3, axis=1), "all_gather out=")
    big = np.arange(STREAM_BYTES // 8 + 3, dtype=np.int64) * (pg.rank + 1)  # a block past the streamed copy's size
    same(pg.all_gather(big), np.stack([big // (pg.rank + 1) * (r + 1) for r in range(pg.size)]), "all_gather 32 MiB")


@case
def reduce_scatter_ops_and_dtypes(pg: ProcessGroup) -> None:
    n = pg.size
    for dtype in ("float32", "float64", "int64", "bfloat16", "float16", "bool"):
        for op in ARITHMETIC:
            if refused(dtype, op):
                continue
            for shape in [(n,), (n * 7, 3), (n * 10_007,)]:
                xs = inputs(n, shape, dtype)
                got = pg.reduce_scatter(xs[pg.rank].copy(), op)
                rows = shape[0] // n
                same(got, reference(xs, op)[pg.rank * rows:(pg.rank + 1) * rows], f"reduce_scatter {op} {dtype}")


@case
def gather_and_scatter(pg: ProcessGroup) -> None:
    n = pg.size
    for dtype in ("float32", "bool", "bfloat16", "int16"):
        for root in range(n):
            xs = inputs(n, (4, 3), dtype, seed=root)
            got = pg.gather(xs[pg.rank], root)
            if pg.rank == root:
                same(got, np.stack(xs), f"gather {dtype} dst={root}")
            else:
                assert got is None
            full = np.stack(xs) if pg.rank == root else None
            same(pg.scatter(full, root), xs[pg.rank], f"scatter {dtype} src={root}")


@case
def all_to_all_even_and_uneven(pg: ProcessGroup) -> None:
    n, r = pg.size, pg.rank
    x = np.arange(n * 6, dtype=np.float32).reshape(n * 2, 3) + 100 * r
    got = pg.all_to_all(x)
    expected = np.concatenate([(np.arange(n * 6, dtype=np.float32).reshape(n * 2, 3) + 100 * p)[2 * r:2 * r + 2]
                               for p in range(n)])
    same(got, expected, "all_to_all even")
    sends = [(r + d) % 3 for d in range(n)]  # rank r sends (r + d) % 3 rows to rank d
    y = np.concatenate([np.full((k, 2), 10 * r + d, np.int32) for d, k in enumerate(sends)]) if sum(sends) else \
        np.zeros((0, 2), np.int32)
    for outs in (None, [(p + r) % 3 for p in range(n)]):
        got = pg.all_to_all(y, input_split_sizes=sends, output_split_sizes=outs)
        want = np.concatenate([np.full(((p + r) % 3, 2), 10 * p + r, np.int32) for p in range(n)])
        same(got, want, f"all_to_all uneven outs={outs}")


@case
def send_recv_and_async_p2p(pg: ProcessGroup) -> None:
    n, r = pg.size, pg.rank
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in ("float64", "bfloat16", "bool"):
        mine = make(r, (1000,), dtype)
        got = np.empty_like(mine)
        send = pg.isend(mine, right, tag=5)
        pg.recv(got, left, tag=5)
        send.wait()
        same(got, make(left, (1000,), dtype), f"ring {dtype}")
    big = np.full(3_000_000, r, np.float32)  # past the eager limit: the send waits for the receive
    into = np.empty_like(big)
    works = axond.batch_isend_irecv([axond.P2POp(axond.isend, big, right, pg, 9),
                                     axond.P2POp(axond.irecv, into, left, pg, 9)])
    for w in works:
        w.wait()
    assert (into == left).all()


@case
def async_ops_complete_in_issue_order(pg: ProcessGroup) -> None:
    xs = [np.full(100_000, i + pg.rank, np.float64) for i in range(6)]
    works = [pg.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait(timeout=60)
        assert w.is_completed()
    for i, x in enumerate(xs):
        assert (x == pg.size * i + pg.size * (pg.size - 1) / 2).all()
    pg.barrier()


@case
def subgroups_are_mpi_communicators(pg: ProcessGroup) -> None:
    n, r = pg.size, pg.rank
    evens = axond.new_group([p for p in range(n) if p % 2 == 0])
    tail = axond.new_group(list(range(1, n)))
    if r % 2 == 0:
        x = np.array([r], np.int64)
        evens.all_reduce(x)
        assert int(x[0]) == sum(range(0, n, 2)), x
        assert evens.rank == r // 2
    if r >= 1:
        assert tail.rank == r - 1
        got = tail.all_gather(np.array([r]))
        same(got.ravel(), np.arange(1, n), "all_gather on ranks 1..n-1")
        y = np.array([10.0 * r])
        tail.broadcast(y, tail.size - 1)
        assert y[0] == 10.0 * (n - 1), y
    for g in (evens, tail):
        g.destroy()


@case
def the_prepared_way_runs_and_checks_every_call(pg: ProcessGroup) -> None:
    """The second call of a signature runs the backend's prepared runner (the fast path): same results, a member that
    takes the full way for the same call (a non-contiguous input) still meets it, and a different call still raises
    on every rank, naming the peer."""
    g = axond.new_group(list(range(pg.size)), timeout=30)
    n, r = g.size, g.rank
    total = n * (n + 1) / 2
    for _ in range(3):
        x = np.full((4, 3), r + 1, np.float32)
        g.all_reduce(x)
        same(x, np.full((4, 3), total, np.float32), "all_reduce")
        y = np.arange(6, dtype=np.float16) * (r + 1)
        g.all_reduce(y, axond.ReduceOp.AVG)
        same(y, np.arange(6, dtype=np.float16) * np.float16(total / n), "all_reduce avg float16")
        b = np.full(5, r, np.int64)
        g.broadcast(b, n - 1)
        same(b, np.full(5, n - 1, np.int64), "broadcast")
        same(g.all_gather(np.full(3, r, np.int32)), np.repeat(np.arange(n, dtype=np.int32)[:, None], 3, 1), "gather")
        out = np.empty((n, 3), np.int32)
        assert g.all_gather(np.full(3, r, np.int32), out=out) is out
        got = g.reduce_scatter(np.full((n * 2, 2), r + 1, np.float64), axond.ReduceOp.SUM)
        same(got, np.full((2, 2), total, np.float64), "reduce_scatter")
        g.barrier()
        # 4 KiB and more: two members run these as messages (`plans.duo_*`), the prepared way too
        big = np.arange(n * 2048, dtype=np.float32).reshape(n * 1024, 2) * (r + 1)
        got = g.reduce_scatter(big, axond.ReduceOp.MAX, out=np.empty((1024, 2), np.float32))
        same(got, (np.arange(n * 2048, dtype=np.float32).reshape(n * 1024, 2) * n)[r * 1024:(r + 1) * 1024], "max")
        flags = np.arange(n * 4096) % (r + 2) == 0
        got = g.reduce_scatter(flags, axond.ReduceOp.SUM)
        want = np.logical_or.reduce([np.arange(n * 4096) % (p + 2) == 0 for p in range(n)])
        same(got, want.reshape(n, -1)[r], "reduce_scatter bool")
        same(g.all_gather(np.full(2048, r, np.int16)), np.repeat(np.arange(n, dtype=np.int16)[:, None], 2048, 1),
             "all_gather 4 KiB")
        c = np.full(1500, r, np.float64)
        g.broadcast(c, 0)
        same(c, np.zeros(1500), "broadcast 12 KB")
        m = np.arange(1 << 14, dtype=np.float32) * (r + 1)  # 64 KiB: two members send a copy (`plans.duo_copies`)
        g.all_reduce(m)
        same(m, np.arange(1 << 14, dtype=np.float32) * np.float32(total), "all_reduce 64 KiB")
    assert len(g.fast_path) >= 10, g.fast_path.runners()
    base = np.full((8, 3), r + 1, np.float32)
    z = base[::2] if r == 0 else np.full((4, 3), r + 1, np.float32)  # rank 0: the full way, the others: prepared
    g.all_reduce(z)
    same(np.ascontiguousarray(z), np.full((4, 3), total, np.float32), "all_reduce full way beside prepared")
    wide = np.arange(1 << 15, dtype=np.float32) * (r + 1)
    m = wide[::2] if r == 0 else np.arange(0, 1 << 15, 2, dtype=np.float32) * (r + 1)  # 64 KiB, as above
    g.all_reduce(m)
    same(np.ascontiguousarray(m), np.arange(0, 1 << 15, 2, dtype=np.float32) * np.float32(total),
         "all_reduce 64 KiB full way beside prepared")
    x = np.ones((4, 3), np.float32)
    msg = _raised(lambda: g.all_reduce(x) if r == 0 else g.all_reduce(np.ones((4, 3), np.int32)))
    assert "all_reduce" in msg and "peer rank" in msg and "int32" in msg and "float32" in msg, msg
    g.destroy()


def _raised(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except DistributedError as e:
        return str(e)
    raise AssertionError("no DistributedError")


@case
def a_different_call_raises_on_every_rank(pg: ProcessGroup) -> None:
    g = axond.new_group(list(range(pg.size)), timeout=30)
    x = np.ones(7, np.float32)
    msg = _raised(lambda: g.all_reduce(x) if g.rank == 0 else g.broadcast(x, 0))
    assert "all_reduce" in msg and "broadcast" in msg and "peer rank" in msg, msg
    msg = _raised(lambda: g.all_reduce(x))  # the group is aborted: later ops raise at once
    assert "aborted" in msg, msg
    g.destroy()
    g = axond.new_group(list(range(pg.size)), timeout=30)
    msg = _raised(lambda: g.all_reduce(np.ones(7 + (g.rank == 1), np.float32)))
    assert ("7 elements" in msg and "8 elements" in msg) or "peer rank 1" in msg, msg
    g.destroy()
    # a peer's op of 1 MiB against 8 KiB (Open MPI would write the longer message past the shorter buffer), and a
    # peer's data against a barrier: raised on every rank before any op's data moves
    for last, others in ((lambda g: g.all_gather(np.ones(1 << 18, np.float32)),
                          lambda g: g.all_gather(np.ones(2048, np.float32))),
                         (lambda g: g.broadcast(np.ones(1 << 18, np.float32), 0), lambda g: g.barrier()),
                         (lambda g: g.all_reduce(np.ones(1 << 14, np.float32)),  # 64 KiB, a copy sent on two ranks
                          lambda g: g.all_reduce(np.ones(1 << 14, np.int32)))):
        g = axond.new_group(list(range(pg.size)), timeout=30)
        msg = _raised(lambda: last(g) if g.rank == g.size - 1 else others(g))
        assert "peer rank" in msg and "called" in msg, msg
        g.destroy()


@case
def ranks_wait_without_yielding_unless_they_outnumber_their_host_s_cores(pg: ProcessGroup) -> None:
    """The mpi backend's polls yield the core (`spin` 0) only where the members on a host outnumber the cores they
    may run on, all of them together: `mpirun` binds each of two ranks to a core of its own, and leaves more ranks
    than cores unbound; AXOND_MPI_SPIN, where set, is kept (tests/cluster/test_netns_mpi.py)."""
    if sys.argv[1] != "mpi":
        return
    from mpi4py import MPI

    from axond.distributed.backends.mpi.options import SPIN

    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cores = set().union(*local.allgather(sorted(os.sched_getaffinity(0))))
    members = local.Get_size()
    local.Free()
    spin = pg.backend.ch.spin  # type: ignore[attr-defined]
    given = os.environ.get("AXOND_MPI_SPIN")
    expected = int(given) if given else SPIN if members <= len(cores) else 0
    assert spin == expected, (spin, given, members, sorted(cores))


@case
def a_silent_peer_times_out_and_the_group_aborts(pg: ProcessGroup) -> None:
    g = axond.new_group(list(range(pg.size)), timeout=2.0)
    if g.rank != 0:
        t0 = time.monotonic()
        msg = _raised(lambda: g.all_reduce(np.ones(5)))
        assert "timed out" in msg or "aborted" in msg, msg
        assert time.monotonic() - t0 < 30
    pg.barrier()  # rank 0 was told: its next op on the group raises, naming a peer
    if g.rank == 0:
        msg = _raised(lambda: g.all_reduce(np.ones(5)))
        assert "aborted" in msg and "peer rank" in msg, msg


@case
def a_silent_peer_times_out_the_prepared_way_too(pg: ProcessGroup) -> None:
    g = axond.new_group(list(range(pg.size)), timeout=2.0)
    for _ in range(2):
        g.all_reduce(np.ones(5))
    assert len(g.fast_path) == 1, g.fast_path.runners()
    if g.rank != 0:
        t0 = time.monotonic()
        msg = _raised(lambda: g.all_reduce(np.ones(5)))  # the prepared runner: its wait has the group's deadline
        assert "timed out" in msg or "aborted" in msg, msg
        assert time.monotonic() - t0 < 30
    pg.barrier()
    if g.rank == 0:
        msg = _raised(lambda: g.all_reduce(np.ones(5)))
        assert "aborted" in msg and "peer rank" in msg, msg


@case
def unchecked_two_members_never_receive_a_longer_message(pg: ProcessGroup) -> None:
    """Without the call check (`MpiOptions.check_calls` off), two members still tag their messages with the length:
    a peer's 1 MiB all_gather against an 8 KiB one times out on both, and writes nothing past the shorter buffer."""
    g = axond.new_group([0, 1], timeout=2.0)
    if pg.rank < 2:
        g.backend.check_calls = False
        x = np.ones((1 << 18) if g.rank == 1 else 2048, np.float32)
        msg = _raised(lambda: g.all_gather(x))
        assert "timed out" in msg or "aborted" in msg, msg


@case
def a_failed_rank_s_reason_reaches_the_others(pg: ProcessGroup) -> None:
    g = axond.new_group(list(range(pg.size)), timeout=60.0)
    if g.rank == 1:
        g.backend.abort_failed("rank 1 failed: ValueError: boom")
    else:
        t0 = time.monotonic()
        try:
            g.all_reduce(np.ones(1 << 16))
        except DistributedError as e:
            assert "boom" in str(e) and e.root_cause is not None and "rank 1" in e.root_cause, (str(e), e.root_cause)
            assert time.monotonic() - t0 < 30
        else:
            raise AssertionError("no DistributedError")
    pg.barrier()


def main() -> int:
    backend, out = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3:])
    pg = axond.init_process_group(backend, timeout=120)
    failures: list[list[Any]] = []
    ran = 0
    for fn in CASES:
        if only and fn.__name__ not in only:
            continue
        if backend != "mpi" and fn.__name__.startswith(("a_silent", "a_failed", "unchecked")):
            continue  # these use the mpi backend's own abort channel (tcp has its own tests)
        ran += 1
        try:
            fn(pg)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next case runs
            failures.append([pg.rank, fn.__name__, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"])
        pg.barrier()
    everyone = _gather(pg, failures)
    hosts = _gather(pg, socket.gethostname())
    if pg.rank == 0:
        Path(out).write_text(json.dumps({"size": pg.size, "backend": pg.backend_name, "cases": ran, "hosts": hosts,
                                         "failures": [f for fs in everyone for f in fs]}))
    axond.destroy_process_group()
    return 0


def _gather(pg: ProcessGroup, value: Any) -> list[Any]:
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = pg.all_gather(np.array([data.size], np.int64)).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = pg.all_gather(padded)
    return [json.loads(bytes(rows[p][:sizes[p]]).decode()) for p in range(pg.size)]


if __name__ == "__main__":
    sys.exit(main())
