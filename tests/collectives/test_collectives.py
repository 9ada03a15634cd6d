"""Every collective against a NumPy reference: world sizes 1-4 (8 for some), every dtype and ReduceOp, odd sizes.

Ranks are threads of this process joined by real loopback sockets (one group per world size and
transport, reused across tests): with the default settings, with sockets only, and with every op
through the shared-memory arena; and, held to the same contract, threads of the socket-free mock backend. Inputs are small integers so that float sums are exact and independent
of the reduction order; a separate test checks random floats for cross-rank bitwise agreement.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup, ReduceOp
from axond.testing import run_on, thread_groups
from axond import bfloat16
from collective_cases import (
    ARITHMETIC, BITWISE_UFUNCS, DTYPES, EVERY_TRANSPORT, LOW_PRECISION, SHAPES, group_members, make, reference,
    refused,
)


QUICK_SIZES = {"auto": (1, 2, 3, 4), "mock": (1, 2, 3, 4)}
"""World sizes of each transport that the quick loop (`-m "not slow"`) runs; the other transports at 2 and 4 (3, an
odd size, still runs on the default transport and the mock backend there). The full suite runs every one."""


@pytest.fixture(scope="module", params=[p if n in QUICK_SIZES.get(t, (2, 4)) else pytest.param(p, marks=pytest.mark.slow)
                                        for p in EVERY_TRANSPORT for n, t in [p]],
                ids=[f"{n}-{t}" for n, t in EVERY_TRANSPORT])
def groups(request: pytest.FixtureRequest) -> Iterator[list[ProcessGroup]]:
    """As conftest's, on every transport: the defaults, sockets only, shared memory for every op, and the mock backend."""
    yield from group_members(*request.param)


@pytest.fixture(scope="module")
def groups8() -> Iterator[list[ProcessGroup]]:
    gs = thread_groups(8, timeout=20.0)
    yield gs
    for g in gs:
        g.destroy()


@pytest.mark.parametrize("dtype", DTYPES + LOW_PRECISION)
@pytest.mark.parametrize("op", ARITHMETIC)
def test_all_reduce_every_op_dtype_and_size(groups: list[ProcessGroup], op: ReduceOp, dtype: str) -> None:
    if refused(dtype, op):
        pytest.skip("AVG on bool and integers is refused (test_avg_on_bool_and_integers_is_refused)")
    n = len(groups)
    for shape in SHAPES:
        inputs = [make(r, shape, dtype) for r in range(n)]
        expected = reference(inputs, op)

        def body(pg: ProcessGroup) -> np.ndarray:
            x = inputs[pg.rank].copy()
            pg.all_reduce(x, op)
            return x

        for r, got in enumerate(run_on(groups, body)):
            assert got.shape == expected.shape and got.dtype == expected.dtype
            np.testing.assert_array_equal(got, expected, err_msg=f"rank {r} shape {shape} {op} {dtype}")


@pytest.mark.parametrize("dtype", ["int8", "int64", "uint8", "bool"])
@pytest.mark.parametrize("op", sorted(BITWISE_UFUNCS, key=lambda o: o.name))
def test_bitwise_all_reduce_on_integers_and_bool(groups: list[ProcessGroup], op: ReduceOp, dtype: str) -> None:
    n = len(groups)
    for shape in [(), (13,), (40_009,)]:  # the mailbox, and past every path's threshold
        inputs = [make(r, shape, dtype, seed=7) for r in range(n)]
        expected = reference(inputs, op)
        for r, got in enumerate(run_on(groups, lambda pg: _reduced(pg, inputs[pg.rank], op))):
            np.testing.assert_array_equal(got, expected, err_msg=f"rank {r} shape {shape} {op} {dtype}")


def _reduced(pg: ProcessGroup, x: np.ndarray, op: ReduceOp) -> np.ndarray:
    x = x.copy()
    pg.all_reduce(x, op)
    return x


def test_bitwise_ops_are_refused_on_floats(groups: list[ProcessGroup]) -> None:
    with pytest.raises(TypeError, match=r"BXOR is bitwise: defined on integer and bool arrays only, not float32"):
        groups[0].all_reduce(np.ones(3, np.float32), ReduceOp.BXOR)


def test_avg_on_bool_and_integers_is_refused(groups: list[ProcessGroup]) -> None:
    with pytest.raises(TypeError, match="AVG is undefined on bool"):
        groups[0].all_reduce(np.ones(3, bool), ReduceOp.AVG)
    for dtype in ("int8", "int32", "uint8", "int64"):
        with pytest.raises(TypeError, match=rf"AVG is refused on integer arrays \({dtype}\).*ReduceOp.SUM"):
            groups[0].all_reduce(np.ones(3, dtype), ReduceOp.AVG)
        with pytest.raises(TypeError, match="AVG is refused on integer arrays"):
            groups[0].reduce_scatter(np.ones(len(groups), dtype), ReduceOp.AVG)


def test_all_reduce_random_floats_agree_bitwise_across_ranks(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    for size in (5, 300_007):
        inputs = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(n)]

        def body(pg: ProcessGroup) -> np.ndarray:
            x = inputs[pg.rank].copy()
            pg.all_reduce(x, ReduceOp.SUM)
            return x

        out = run_on(groups, body)
        for got in out[1:]:
            assert got.tobytes() == out[0].tobytes()
        # float32 summation of n values in a different order than NumPy's: a few ulps of the total.
        np.testing.assert_allclose(out[0], np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_bfloat16_sums_accumulate_in_float32_and_round_once(groups: list[ProcessGroup], op: ReduceOp) -> None:
    n = len(groups)
    for size in (5, 300_007):
        inputs = [np.random.default_rng(r).standard_normal(size).astype(bfloat16) for r in range(n)]
        wide = np.sum([x.astype(np.float64) for x in inputs], axis=0) / (n if op is ReduceOp.AVG else 1)

        def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            x = inputs[pg.rank].copy()
            pg.all_reduce(x, op)
            rs = pg.reduce_scatter(inputs[pg.rank][: size - size % n].copy(), op)
            r = inputs[pg.rank].copy()
            pg.reduce(r, 0, op)
            return x, rs, r

        out = run_on(groups, body)
        for x, _, _ in out:
            assert x.dtype == bfloat16 and x.tobytes() == out[0][0].tobytes()
        # One rounding of a float32 sum: within half a bfloat16 ulp (2**-9 relative) plus float32's few ulps;
        # rounding at every hop instead would drift by up to (n - 1) half-ulps.
        np.testing.assert_allclose(out[0][0].astype(np.float64), wide, rtol=2**-8, atol=1e-6)
        np.testing.assert_array_equal(out[0][2], out[0][0])
        block = (size - size % n) // n
        assert all(rs.shape == (block,) and rs.dtype == bfloat16 for _, rs, _ in out)
        got = np.concatenate([rs for _, rs, _ in out]).astype(np.float64)
        np.testing.assert_allclose(got, wide[: block * n], rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_moves_bit_exact(groups: list[ProcessGroup], dtype: str) -> None:
    n = len(groups)
    inputs = [make(r, (n * 3, 5), dtype) * 0.37 for r in range(n)]
    inputs = [x.astype(bfloat16 if dtype == "bfloat16" else dtype) for x in inputs]

    def body(pg: ProcessGroup) -> tuple[np.ndarray, ...]:
        b = inputs[pg.rank].copy()
        pg.broadcast(b, n - 1)
        return b, pg.all_gather(inputs[pg.rank]), pg.all_to_all(inputs[pg.rank]), pg.scatter(
            np.stack(inputs) if pg.rank == 0 else None, 0)

    for r, (b, ag, a2a, sc) in enumerate(run_on(groups, body)):
        assert b.tobytes() == inputs[n - 1].tobytes() and ag.tobytes() == np.stack(inputs).tobytes()
        assert a2a.tobytes() == np.concatenate([x[r * 3 : (r + 1) * 3] for x in inputs]).tobytes()
        assert sc.dtype == inputs[0].dtype and sc.tobytes() == inputs[r].tobytes()


def test_all_reduce_non_contiguous_in_place(groups: list[ProcessGroup]) -> None:
    n = len(groups)

    def body(pg: ProcessGroup) -> np.ndarray:
        base = np.zeros((6, 10), np.float64)
        view = base[:, ::3]
        view[...] = pg.rank + 1
        pg.all_reduce(view, ReduceOp.SUM)
        return base

    for base in run_on(groups, body):
        assert (base[:, ::3] == n * (n + 1) / 2).all()
        mask = np.ones(10, bool)
        mask[::3] = False
        assert (base[:, mask] == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "bool", "float16"])
def test_broadcast_from_every_src(groups: list[ProcessGroup], dtype: str) -> None:
    n = len(groups)
    for src in range(n):
        for shape in [(), (0,), (1,), (13,), (70_001,)]:
            inputs = [make(r, shape, dtype, seed=src) for r in range(n)]

            def body(pg: ProcessGroup) -> np.ndarray:
                x = inputs[pg.rank].copy()
                pg.broadcast(x, src)
                return x

            for got in run_on(groups, body):
                np.testing.assert_array_equal(got, inputs[src])


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG])
def test_reduce_to_every_dst(groups: list[ProcessGroup], op: ReduceOp) -> None:
    n = len(groups)
    for dst in range(n):
        for shape in [(), (7,), (50_000,)]:
            inputs = [make(r, shape, "float64", seed=dst) for r in range(n)]

            def body(pg: ProcessGroup) -> np.ndarray:
                x = inputs[pg.rank].copy()
                pg.reduce(x, dst, op)
                return x

            out = run_on(groups, body)
            np.testing.assert_array_equal(out[dst], reference(inputs, op))
            for r, got in enumerate(out):
                assert got.shape == inputs[r].shape


@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "float64"])
def test_all_gather(groups: list[ProcessGroup], dtype: str) -> None:
    n = len(groups)
    for shape in [(), (0,), (1,), (3, 5), (100_003,)]:
        inputs = [make(r, shape, dtype) for r in range(n)]
        for got in run_on(groups, lambda pg: pg.all_gather(inputs[pg.rank])):
            assert got.shape == (n, *shape)
            np.testing.assert_array_equal(got, np.stack(inputs))


@pytest.mark.parametrize("op", list(ReduceOp))
def test_reduce_scatter(groups: list[ProcessGroup], op: ReduceOp) -> None:
    n = len(groups)
    for rows, tail in [(1, ()), (3, (5,)), (7, ()), (40_001, ())]:
        inputs = [make(r, (n * rows, *tail), "float64" if op is ReduceOp.AVG else "int32") for r in range(n)]
        expected = reference(inputs, op)
        out = run_on(groups, lambda pg: pg.reduce_scatter(inputs[pg.rank].copy(), op))
        for r, got in enumerate(out):
            np.testing.assert_array_equal(got, expected[r * rows : (r + 1) * rows])


def test_reduce_scatter_rejects_indivisible_rows(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    if n == 1:
        pytest.skip("every size divides by 1")
    with pytest.raises(ValueError, match="divisible by the group size"):
        groups[0].reduce_scatter(np.ones(n + 1, np.float32))


def test_gather_and_scatter(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    for root in range(n):
        for shape in [(), (6,), (2, 3)]:
            inputs = [make(r, shape, "float32", seed=root) for r in range(n)]
            out = run_on(groups, lambda pg: pg.gather(inputs[pg.rank], root))
            for r, got in enumerate(out):
                if r == root:
                    np.testing.assert_array_equal(got, np.stack(inputs))
                else:
                    assert got is None
            tail = () if shape == () else (12,)
            full = np.arange(n * int(np.prod(tail)), dtype=np.int16).reshape(n, *tail)
            out = run_on(groups, lambda pg: pg.scatter(full if pg.rank == root else None, root))
            for r, got in enumerate(out):
                np.testing.assert_array_equal(got, full[r])
                assert got.dtype == full.dtype


def test_all_to_all(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    for rows in (1, 3, 20_000):
        inputs = [np.arange(n * rows * 2, dtype=np.float64).reshape(n * rows, 2) + 1000 * r for r in range(n)]
        out = run_on(groups, lambda pg: pg.all_to_all(inputs[pg.rank]))
        for r, got in enumerate(out):
            expected = np.concatenate([inputs[s][r * rows : (r + 1) * rows] for s in range(n)])
            np.testing.assert_array_equal(got, expected)


def test_send_recv_ring_with_tags(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    if n == 1:
        pytest.skip("needs a peer")

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        got = []
        for tag, size in ((0, 1), (7, 100_000), (3, 0)):
            x = np.full(size, pg.rank * 10 + tag, np.int64)
            y = np.empty(size, np.int64)
            if pg.rank % 2 == 0:
                pg.send(x, (pg.rank + 1) % n, tag)
                pg.recv(y, (pg.rank - 1) % n, tag)
            else:
                pg.recv(y, (pg.rank - 1) % n, tag)
                pg.send(x, (pg.rank + 1) % n, tag)
            got.append(y)
        return got

    for r, got in enumerate(run_on(groups, body)):
        left = (r - 1) % n
        for y, tag in zip(got, (0, 7, 3)):
            assert (y == left * 10 + tag).all()


def test_sends_issued_before_collectives_are_received_after_them(groups: list[ProcessGroup]) -> None:
    """Each rank isends to its right (a small, a large and an empty message, with tags), then runs collectives of every
    path (mailbox, arena, socket latency and ring paths, exchanges) and only then receives from its left, as MPI and
    torch allow: the collectives set the frames that came before theirs aside, and the receives take them."""
    n = len(groups)
    if n == 1:
        pytest.skip("needs a peer")
    sizes = {1: 10, 2: 300_000, 3: 0}

    def body(pg: ProcessGroup) -> tuple[list[np.ndarray], list[float]]:
        right, left = (pg.rank + 1) % n, (pg.rank - 1) % n
        works = [pg.isend(np.full(size, pg.rank * 10 + tag, np.int64), right, tag) for tag, size in sizes.items()]
        sums = []
        for rows in (4, 3_000, 200_000):  # mailbox / latency path, arena or recursive doubling, arena or ring
            x = np.full(rows, pg.rank + 1.0)
            pg.all_reduce(x)
            sums.append(float(x[0]))
        gathered = pg.all_gather(np.full(600_000, pg.rank, np.int8))  # direct exchange or doubling on sockets
        sums.append(float(gathered[:, 0].sum()))
        pg.barrier()
        got = []
        for tag, size in sizes.items():
            y = np.empty(size, np.int64)
            pg.recv(y, left, tag)
            got.append(y)
        for w in works:
            w.wait()
        return got, sums

    want = n * (n + 1) / 2
    for r, (got, sums) in enumerate(run_on(groups, body)):
        assert sums == [want, want, want, n * (n - 1) / 2]
        for y, (tag, size) in zip(got, sizes.items()):
            assert y.shape == (size,) and (y == ((r - 1) % n) * 10 + tag).all()


@pytest.mark.slow  # many rank processes or deadlines waited out: the full run, not the quick loop
@pytest.mark.parametrize("transport", ["auto", "sockets", "spin", "mock"])
def test_a_send_set_aside_by_a_collective_is_still_checked_against_its_receive(make_groups: Any,
                                                                               transport: str) -> None:
    """Sends and receives match per tag: a receive of a tag never sent times out naming the tag that was sent."""
    groups = make_groups(2, 1.0, transport=transport)  # fresh: the error aborts them

    def body(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.isend(np.ones(5, np.float32), 1, tag=4).wait()
        pg.all_reduce(np.ones(100_000))
        if pg.rank == 1:
            pg.recv(np.empty(5, np.float32), 0, tag=5)
    errors = run_on(groups, body, return_exceptions=True)
    assert isinstance(errors[1], DistributedError), errors
    assert "tag=4" in str(errors[1]) and "tag=5" in str(errors[1]), errors


def test_barrier_and_many_small_ops_stay_in_step(groups: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> int:
        x = np.zeros(1, np.int64)
        for i in range(200):
            x[0] = i
            pg.all_reduce(x, ReduceOp.MAX)
            assert x[0] == i
            if i % 50 == 0:
                pg.barrier()
        return int(x[0])

    assert run_on(groups, body) == [199] * len(groups)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN])
def test_world_of_8(groups8: list[ProcessGroup], op: ReduceOp) -> None:
    inputs = [make(r, (1031,), "float64") for r in range(8)]
    big = [make(r, (70_000,), "int32") for r in range(8)]

    int_op = ReduceOp.SUM if op is ReduceOp.AVG else op  # AVG is refused on integers

    def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x, y = inputs[pg.rank].copy(), big[pg.rank].copy()
        pg.all_reduce(x, op)
        pg.all_reduce(y, int_op)
        z = np.full(5, pg.rank, np.int8)
        pg.broadcast(z, 5)
        return x, y, z

    for x, y, z in run_on(groups8, body):
        np.testing.assert_array_equal(x, reference(inputs, op))
        np.testing.assert_array_equal(y, reference(big, int_op))
        assert (z == 5).all()


def test_all_gather_and_reduce_scatter_into_out(groups: list[ProcessGroup]) -> None:
    n = len(groups)

    def body(pg: ProcessGroup) -> tuple[bool, bool]:
        out = np.empty((n, 3), np.int32)
        got = pg.all_gather(np.full(3, pg.rank, np.int32), out=out)
        block = np.empty(2, np.int32)
        rs = pg.reduce_scatter(np.ones(2 * n, np.int32), out=block)
        with pytest.raises(ValueError, match="out= must be"):
            pg.all_gather(np.zeros(3, np.int32), out=np.empty((n, 4), np.int32))
        return got is out and (out == np.arange(n)[:, None]).all(), rs is block and (block == n).all()

    assert run_on(groups, body) == [(True, True)] * n
