"""The short way of a blocking op (`axond.distributed.fast_path`) gives what the full way gives: one table of ops and
signatures, each run the full way (the backend's method), then through the group twice (the full way, which
prepares, then the short way), on every rank; the short way skips the route (`Placement.choose` is not called)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from axond.distributed import BackendOptions, ProcessGroup, ReduceOp
from axond.testing import run_on, thread_groups

Case = tuple[str, Callable[[int, int], Any], Callable[[Any, Any], Any], Callable[[ProcessGroup, Any], Any], bool]
"""(id, input of rank r of n, the backend's full way on it, the group's method on it, whether it runs short)."""


def _data(dtype: Any, shape: tuple[int, ...]) -> Callable[[int, int], np.ndarray]:
    def make(rank: int, size: int) -> np.ndarray:
        real = (size * 2, *shape[1:]) if shape[0] == -1 else shape  # -1: two rows per rank (reduce_scatter)
        return (np.arange(int(np.prod(real))) * (rank + 1) % 7 + rank).astype(dtype).reshape(real)
    return make


TABLE: list[Case] = [
    ("all_reduce-f32-sum", _data(np.float32, (5,)), lambda b, x: b.all_reduce(x, ReduceOp.SUM) or x,
     lambda g, x: g.all_reduce(x, ReduceOp.SUM) or x, True),
    ("all_reduce-f64-avg-2d", _data(np.float64, (3, 4)), lambda b, x: b.all_reduce(x, ReduceOp.AVG) or x,
     lambda g, x: g.all_reduce(x, ReduceOp.AVG) or x, True),
    ("all_reduce-i64-max", _data(np.int64, (7,)), lambda b, x: b.all_reduce(x, ReduceOp.MAX) or x,
     lambda g, x: g.all_reduce(x, ReduceOp.MAX) or x, True),
    ("all_reduce-u8-bxor", _data(np.uint8, (9,)), lambda b, x: b.all_reduce(x, ReduceOp.BXOR) or x,
     lambda g, x: g.all_reduce(x, ReduceOp.BXOR) or x, True),
    ("all_reduce-not-contiguous", _data(np.float32, (4, 6)), lambda b, x: b.all_reduce(x[:, ::2], ReduceOp.SUM) or x,
     lambda g, x: g.all_reduce(x[:, ::2], ReduceOp.SUM) or x, False),
    ("broadcast-root-0", _data(np.float32, (10,)), lambda b, x: b.broadcast(x, 0) or x,
     lambda g, x: g.broadcast(x, 0) or x, True),
    ("broadcast-root-1-i32", _data(np.int32, (2, 3)), lambda b, x: b.broadcast(x, 1) or x,
     lambda g, x: g.broadcast(x, 1) or x, True),
    ("all_gather", _data(np.float32, (2, 3)), lambda b, x: b.all_gather(x), lambda g, x: g.all_gather(x), True),
    ("all_gather-into-out", _data(np.int64, (4,)),
     lambda b, x: b.all_gather(x, np.empty((b.size, 4), np.int64)),
     lambda g, x: g.all_gather(x, out=np.empty((g.size, 4), np.int64)), True),
    ("reduce_scatter-sum", _data(np.float32, (-1, 3)), lambda b, x: b.reduce_scatter(x, ReduceOp.SUM),
     lambda g, x: g.reduce_scatter(x, ReduceOp.SUM), True),
    ("reduce_scatter-min-into-out", _data(np.float64, (-1,)),
     lambda b, x: b.reduce_scatter(x, ReduceOp.MIN, np.empty(2, np.float64)),
     lambda g, x: g.reduce_scatter(x, ReduceOp.MIN, out=np.empty(2, np.float64)), True),
    ("barrier", lambda r, n: None, lambda b, x: b.barrier(), lambda g, x: g.barrier(), True),
]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"n{n}")
def groups(request: pytest.FixtureRequest) -> Any:
    gs = thread_groups(request.param, options=BackendOptions(timeout=20.0))
    yield gs
    for g in gs:
        g.destroy()


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_the_short_way_gives_what_the_full_way_gives(groups: list[ProcessGroup], case: Case) -> None:
    _, make, full, method, short = case
    for g in groups:
        g.fast_path.clear()  # every case starts unprepared

    def body(g: ProcessGroup) -> tuple[list[Any], list[int]]:
        b = g.backend
        assert b is not None
        routed = []
        choose = b.placement.choose  # type: ignore[attr-defined]

        def counted(*args: Any, **kwargs: Any) -> Any:
            routed.append(1)
            return choose(*args, **kwargs)
        b.placement.choose = counted  # type: ignore[attr-defined]
        try:
            results = [full(b, make(g.rank, g.size))]
            steps = []
            for _ in range(3):
                before = len(routed)
                results.append(method(g, make(g.rank, g.size)))
                steps.append(len(routed) - before)
        finally:
            b.placement.choose = choose  # type: ignore[attr-defined]
        return results, steps

    for results, steps in run_on(groups, body):
        for got in results[1:]:
            if results[0] is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got, results[0])
                assert got.dtype == results[0].dtype
        assert steps[0] == 1  # the first call takes the full way (and prepares)
        assert steps[1:] == ([0, 0] if short else [1, 1]), steps


def test_a_prepared_reduce_scatter_takes_another_shape_of_its_size_only_if_the_rows_split(
        groups: list[ProcessGroup]) -> None:
    """The signature counts elements: a reduce_scatter prepared for (2n, 3) runs (n, 6) the short way, with the full
    way's numbers, and leaves (1, 6n), whose one row the group cannot split, to the full way, which raises."""

    def body(g: ProcessGroup) -> tuple[np.ndarray, np.ndarray, str]:
        n = g.size
        x = np.arange(6 * n, dtype=np.float32) + g.rank
        g.reduce_scatter(x.reshape(2 * n, 3))  # prepares
        short = g.reduce_scatter(x.reshape(n, 6))
        full = g.backend.reduce_scatter(x.reshape(n, 6), ReduceOp.SUM)  # type: ignore[union-attr]
        try:
            g.reduce_scatter(x.reshape(1, 6 * n))
        except ValueError as e:
            return short, full, str(e)
        return short, full, ""

    for short, full, error in run_on(groups, body):
        np.testing.assert_array_equal(short, full)
        assert "reduce_scatter" in error, error
