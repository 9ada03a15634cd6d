"""torch.distributed's call forms beside axond's own, on real thread ranks over loopback (see docs/torch-compat.md)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

import axond
from axond import ProcessGroup, ReduceOp
from axond.distributed import BackendOptions
from axond.testing import run_on, thread_groups


@pytest.fixture(scope="module", params=[1, 3])
def gs(request: pytest.FixtureRequest) -> Iterator[list[ProcessGroup]]:
    groups = thread_groups(request.param, options=BackendOptions(timeout=10.0))
    yield groups
    for g in groups:
        g.destroy()


def test_all_gather_list_form_fills_the_list_and_axond_form_returns_the_stack(gs: list[ProcessGroup]) -> None:
    n = len(gs)

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        t = np.full((2, 3), pg.rank, np.float32)
        outs = [np.empty_like(t) for _ in range(n)]
        assert axond.all_gather(outs, t, group=pg) is None
        outs2 = [np.empty_like(t) for _ in range(n)]
        assert axond.all_gather(outs2, t, pg) is None
        outs3 = [np.empty_like(t) for _ in range(n)]
        work = axond.all_gather(tensor_list=outs3, tensor=t, group=pg, async_op=True)
        assert isinstance(work, axond.Work) and work.wait(timedelta(seconds=10))
        stacked = axond.all_gather(t, pg)
        into = np.empty((n, 2, 3), np.float32)
        assert axond.all_gather(t, group=pg, out=into) is into
        work = axond.all_gather(t, group=pg, async_op=True)
        assert isinstance(work, axond.Work) and work.wait(timedelta(seconds=10))
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            axond.all_gather(t, group=pg, bogus=1)
        return outs, outs2, outs3, stacked, into, work.result()

    for outs, outs2, outs3, stacked, into, later in run_on(gs, body):
        for i in range(n):
            assert (outs[i] == i).all() and (outs2[i] == i).all() and (outs3[i] == i).all()
        assert stacked.shape == (n, 2, 3) and (stacked == np.arange(n)[:, None, None]).all()
        np.testing.assert_array_equal(into, stacked)
        np.testing.assert_array_equal(later, stacked)


def test_reduce_scatter_list_form_and_axond_form(gs: list[ProcessGroup]) -> None:
    n = len(gs)

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        inputs = [np.full(4, 10.0 * pg.rank + i) for i in range(n)]  # entry i goes to rank i
        out = np.empty(4)
        assert axond.reduce_scatter(out, inputs, group=pg) is None
        avg = np.empty(4)
        axond.reduce_scatter(avg, inputs, ReduceOp.AVERAGE, pg)
        ints = np.empty((2, 2), np.int64)
        work = axond.reduce_scatter(output=ints, input_list=[np.full((2, 2), i, np.int64) for i in range(n)],
                                    op=ReduceOp.MAX, group=pg, async_op=True)
        work.wait()
        chunk = axond.reduce_scatter(np.arange(2.0 * n) + pg.rank, ReduceOp.SUM, pg)
        top = np.empty(2)
        assert axond.reduce_scatter(np.arange(2.0 * n) + pg.rank, op=ReduceOp.MAX, group=pg, out=top) is top
        with pytest.raises(TypeError, match="multiple values for argument 'op'"):
            axond.reduce_scatter(np.arange(2.0 * n), ReduceOp.SUM, op=ReduceOp.MAX, group=pg)
        return out, avg, ints, chunk, top

    ranks_sum = 10.0 * sum(range(n))
    for r, (out, avg, ints, chunk, top) in enumerate(run_on(gs, body)):
        np.testing.assert_array_equal(top, np.arange(2.0 * n)[2 * r : 2 * r + 2] + n - 1)
        np.testing.assert_array_equal(out, np.full(4, ranks_sum + n * r))
        np.testing.assert_allclose(avg, np.full(4, (ranks_sum + n * r) / n))
        assert (ints == r).all()
        base = np.arange(2.0 * n)[2 * r : 2 * r + 2] * n + sum(range(n))
        np.testing.assert_array_equal(chunk, base)


def test_gather_list_form_on_dst_and_none_elsewhere(gs: list[ProcessGroup]) -> None:
    n = len(gs)
    dst = n - 1

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        t = np.array([pg.rank, pg.rank * 2], np.int32)
        glist = [np.zeros(2, np.int32) for _ in range(n)] if pg.rank == dst else None
        assert axond.gather(t, glist, dst, pg) is None
        kw = [np.zeros(2, np.int32) for _ in range(n)] if pg.rank == dst else None
        axond.gather(t, gather_list=kw, dst=dst, group=pg)
        mine = axond.gather(t, dst=dst, group=pg)  # axond's form (torch's on non-dst ranks looks the same)
        return glist, kw, mine

    for r, (glist, kw, mine) in enumerate(run_on(gs, body)):
        if r == dst:
            assert [a.tolist() for a in glist] == [[i, 2 * i] for i in range(n)] == [a.tolist() for a in kw]
            assert mine.tolist() == [[i, 2 * i] for i in range(n)]
        else:
            assert glist is None and mine is None


def test_scatter_list_form_and_the_torch_habit_without_a_list_on_other_ranks(gs: list[ProcessGroup]) -> None:
    n = len(gs)
    src = 0
    full = np.arange(n * 3, dtype=np.float64).reshape(n, 3)

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        t = np.zeros(3)
        assert axond.scatter(t, list(full) if pg.rank == src else None, src, pg) is None
        habit = np.zeros(3)
        if pg.rank == src:
            axond.scatter(habit, scatter_list=list(full), src=src, group=pg)
        else:
            axond.scatter(habit, src=src, group=pg)  # torch's call on non-source ranks: habit receives the slice
        untouched = full.copy()
        sliced = axond.scatter(untouched, src, pg)  # axond's form with the whole array everywhere
        work = axond.scatter(np.zeros(3), list(full) if pg.rank == src else None, src=src, group=pg, async_op=True)
        work.wait()
        return t, habit, untouched, sliced

    for r, (t, habit, untouched, sliced) in enumerate(run_on(gs, body)):
        np.testing.assert_array_equal(t, full[r])
        np.testing.assert_array_equal(habit, full[r])
        np.testing.assert_array_equal(sliced, full[r])
        np.testing.assert_array_equal(untouched, full)


def test_all_to_all_single_list_form_and_tensor_forms(gs: list[ProcessGroup]) -> None:
    n = len(gs)

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        r = pg.rank
        x = np.arange(2 * n, dtype=np.float64) + 100 * r
        out = np.empty(2 * n)
        assert axond.all_to_all_single(out, x, group=pg) is None
        ins = [r + 1] * n  # rank r sends r + 1 rows to everyone
        uneven = np.full(sum(ins), float(r))
        got = np.empty(sum(q + 1 for q in range(n)))
        axond.all_to_all_single(got, uneven, [q + 1 for q in range(n)], ins, group=pg)
        outs = [np.empty((q + 1, 2), np.int32) for q in range(n)]
        axond.all_to_all(outs, [np.full((r + 1, 2), 10 * r + j, np.int32) for j in range(n)], group=pg)
        blocks = axond.all_to_all(np.repeat(np.arange(n), 2) * 1.0 + r, pg)
        flat, stacked = np.empty(2 * n), np.empty((n, 2))
        axond.all_gather_into_tensor(flat, np.full(2, float(r)), group=pg)
        axond.all_gather_into_tensor(stacked, np.full(2, float(r)), pg)
        strided = np.zeros((n, 4))[:, ::2]
        axond.all_gather_into_tensor(strided, np.full(2, float(r)), pg)
        rs = np.empty(2)
        axond.reduce_scatter_tensor(rs, np.arange(2.0 * n).reshape(n, 2), ReduceOp.SUM, pg)
        rs_work = axond.reduce_scatter_tensor(np.empty(2), np.arange(2.0 * n), group=pg, async_op=True)
        rs_work.wait()
        return out, got, outs, blocks, flat, stacked, strided, rs

    for r, (out, got, outs, blocks, flat, stacked, strided, rs) in enumerate(run_on(gs, body)):
        np.testing.assert_array_equal(out, [2 * r + k + 100 * q for q in range(n) for k in range(2)])
        np.testing.assert_array_equal(got, np.concatenate([np.full(q + 1, float(q)) for q in range(n)]))
        for q in range(n):
            assert outs[q].shape == (q + 1, 2) and (outs[q] == 10 * q + r).all()
        np.testing.assert_array_equal(blocks, np.repeat(np.arange(n), 2) + float(r))  # block r of every rank q: r + q
        np.testing.assert_array_equal(flat, np.repeat(np.arange(n) * 1.0, 2))
        np.testing.assert_array_equal(stacked, np.repeat(np.arange(n) * 1.0, 2).reshape(n, 2))
        np.testing.assert_array_equal(strided, stacked)
        np.testing.assert_array_equal(rs, n * np.arange(2.0 * n)[2 * r : 2 * r + 2])


def test_recv_returns_the_sender_and_torch_argument_order_works() -> None:
    gs = thread_groups(2, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> tuple[Any, ...]:
            x = np.array([float(pg.rank)])
            if pg.rank == 0:
                axond.send(x + 5, 1, 7, pg)  # axond's order: (x, dst, tag, group)
                axond.send(x + 6, 1, pg, 8)  # torch's order: (x, dst, group, tag)
                axond.isend(x + 7, dst=1, group=pg).wait()
                pg.send(x + 8, 1, 9)
                return None, None, None
            a, b, c, d = np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1)
            sender = axond.recv(a, 0, 7, pg)
            assert axond.recv(b, 0, pg, 8) == 0
            axond.irecv(c, src=0, group=pg).wait()
            return sender, (a[0], b[0], c[0], d[0]) if pg.recv(d, 0, 9) == 0 else None, None
        out = run_on(gs, body)
        assert out[1][0] == 0 and out[1][1] == (5.0, 6.0, 7.0, 8.0)
        with pytest.raises(ValueError, match="src=<global rank>"):
            axond.recv(np.zeros(1), group=gs[0])
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("scalar", [np.float64(1.5), 1.5, 3, np.int32(2)])
def test_scalars_are_refused_saying_to_pass_a_one_element_array(gs: list[ProcessGroup], scalar: Any) -> None:
    pg = gs[0]
    value = scalar.item() if isinstance(scalar, np.generic) else scalar
    with pytest.raises(TypeError, match=rf"all_reduce: got the scalar {value!r}.*np.array\(\[{value!r}\]\)"):
        axond.all_reduce(scalar, group=pg)
    for call in (lambda: axond.broadcast(scalar, 0, pg), lambda: axond.all_gather(scalar, pg),
                 lambda: pg.reduce(scalar), lambda: axond.all_gather([np.zeros(1)] * len(gs), scalar, pg)):
        with pytest.raises(TypeError, match="1-element array"):
            call()


def test_zero_d_arrays_are_reduced_in_place(gs: list[ProcessGroup]) -> None:
    out = run_on(gs, lambda pg: (axond.all_reduce(x := np.array(2.0), group=pg), x)[1])
    assert all(o.shape == () and o == 2.0 * len(gs) for o in out)


def test_integer_avg_is_refused_and_average_is_avg(gs: list[ProcessGroup]) -> None:
    pg = gs[0]
    assert ReduceOp.AVERAGE is ReduceOp.AVG and ReduceOp["AVERAGE"] is ReduceOp.AVG
    with pytest.raises(TypeError, match=r"AVG is refused on integer arrays \(int64\).*ReduceOp.SUM and divide"):
        axond.all_reduce(np.ones(2, np.int64), ReduceOp.AVERAGE, pg)
    out = run_on(gs, lambda pg: (axond.all_reduce(x := np.full(3, pg.rank + 1.0), ReduceOp.AVERAGE, pg), x)[1])
    for x in out:
        np.testing.assert_array_equal(x, np.full(3, (len(gs) + 1) / 2))


def test_wrong_lists_and_arguments_say_what_to_do(gs: list[ProcessGroup]) -> None:
    pg, n = gs[0], len(gs)
    with pytest.raises(ValueError, match=f"tensor_list has {n + 1} arrays; it needs one per group member"):
        axond.all_gather([np.zeros(2)] * (n + 1), np.zeros(2), pg)
    with pytest.raises(ValueError, match=r"tensor_list\[0\] is float32 \(2,\); every entry must be float64 \(2,\)"):
        axond.all_gather([np.zeros(2, np.float32)] * n, np.zeros(2), pg)
    with pytest.raises(ValueError, match="the destination rank needs gather_list"):
        axond.gather(np.zeros(2), None, 0, pg)
    with pytest.raises(TypeError, match="multiple values for argument 'group'"):
        axond.all_gather([np.zeros(2)] * n, np.zeros(2), pg, group=pg)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor'"):
        axond.all_gather(np.zeros(2), tensor=np.zeros(2), group=pg)
    with pytest.raises(ValueError, match="all_gather_into_tensor: output is float64 \\(3,\\)"):
        axond.all_gather_into_tensor(np.zeros(3), np.zeros(2), pg)
    if n > 1:
        with pytest.raises(ValueError, match="gather_list must not be given on ranks other than dst"):
            axond.gather(np.zeros(2), [np.zeros(2)] * n, 1, pg)


def test_new_group_in_torch_order_and_with_gloo(gs: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        a = axond.new_group(None, group=pg)  # all ranks
        b = axond.new_group([0], timedelta(seconds=4), group=pg)  # torch's (ranks, timeout); see test_init_methods
        c = axond.new_group([0], "gloo", pg, 6.0)  # axond's (ranks, backend, group, timeout)
        out = (a.ranks, b.ranks, b.timeout, b.backend_name, c.timeout)
        for sub in (a, b, c):
            sub.destroy()
        return out

    for ranks, b_ranks, b_timeout, b_backend, c_timeout in run_on(gs, body):
        assert ranks == list(range(len(gs))) and b_ranks == [0] and b_timeout == 4.0 and c_timeout == 6.0
    assert run_on(gs, body)[0][3] == "tcp"


def test_ranks_may_mix_the_two_forms(gs: list[ProcessGroup]) -> None:
    """Both forms run the same collective on the wire: rank 0 in torch's form, the others in axond's."""
    n = len(gs)

    def body(pg: ProcessGroup) -> tuple[Any, ...]:
        t = np.full(2, float(pg.rank))
        if pg.rank == 0:
            outs = [np.empty(2) for _ in range(n)]
            axond.all_gather(outs, t, pg)
            block = np.empty(2)
            axond.reduce_scatter(block, [np.full(2, float(i)) for i in range(n)], ReduceOp.SUM, pg)
            return np.stack(outs), block
        return axond.all_gather(t, pg), axond.reduce_scatter(np.repeat(np.arange(n) * 1.0, 2), ReduceOp.SUM, pg)

    for r, (gathered, block) in enumerate(run_on(gs, body)):
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n) * 1.0, 2).reshape(n, 2))
        np.testing.assert_array_equal(block, np.full(2, float(n * r)))
