"""The collective suite on CuPy arrays through NCCL: runs where a GPU is present, skipped elsewhere.

World size 1 runs in this process. Larger worlds run one process per GPU (NCCL refuses two ranks
on one device) through `axond.testing.run_processes` in module mode: it starts `python -m
test_nccl_gpu CASE TIMEOUT` with RANK, WORLD_SIZE, LOCAL_RANK and a shared FileStore, so each rank
picks its GPU from LOCAL_RANK as a worker-launched rank does. Inputs and NumPy references are the
tcp suite's (`test_collectives.make`, `reference`), so both backends answer the same questions.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond
from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.nccl import NcclBackend
from axond.distributed.backends.registry import resolve_backend
from axond.distributed.process_group import ProcessGroup, create_group
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import BackendUnavailable, DistributedError
from axond.store import InMemoryStore
from axond.testing import run_processes
from collective_cases import SHAPES, make, reference
from gpu_cases import REDUCTIONS, need_nccl, nccl_refusal  # noqa: F401 - need_nccl is the fixture

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def need_gpu(need_nccl: None) -> None:
    """Every test here needs NCCL (skipped with the reason elsewhere)."""


def gpu_count() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def cupy_module() -> Any:
    import cupy

    return cupy


def host(x: Any) -> np.ndarray:
    return cupy_module().asnumpy(x)


def case_all_reduce(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    for dtype, op in REDUCTIONS["all_reduce"]:
        for shape in SHAPES:
            x = cp.asarray(make(pg.rank, shape, dtype))
            why = nccl_refusal(dtype, op)
            if why is not None:
                with pytest.raises(TypeError, match=why):
                    pg.all_reduce(x, op)
                continue
            pg.all_reduce(x, op)
            expected = reference([make(r, shape, dtype) for r in range(n)], op)
            assert x.shape == expected.shape and x.dtype == expected.dtype
            np.testing.assert_array_equal(host(x), expected, err_msg=f"{op} {dtype} {shape}")


def case_random_floats_agree_bitwise(pg: ProcessGroup) -> None:
    cp = cupy_module()
    for size in (5, 300_007):
        x = cp.asarray(np.random.default_rng(pg.rank).standard_normal(size).astype(np.float32))
        pg.all_reduce(x, ReduceOp.SUM)
        rows = host(pg.all_gather(x))
        for row in rows[1:]:
            assert row.tobytes() == rows[0].tobytes()
        inputs = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(pg.size)]
        # float32 sums in NCCL's order, not NumPy's: a few ulps of the total.
        np.testing.assert_allclose(rows[0], np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


def case_non_contiguous_in_place(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    base = cp.zeros((6, 10), cp.float64)
    view = base[:, ::3]
    view[...] = pg.rank + 1
    pg.all_reduce(view, ReduceOp.SUM)
    got = host(base)
    assert (got[:, ::3] == n * (n + 1) / 2).all()
    mask = np.ones(10, bool)
    mask[::3] = False
    assert (got[:, mask] == 0).all()


def case_broadcast_and_reduce(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    for src in range(n):
        for dtype in ("float32", "int64", "uint8", "bool", "float16", "int16"):
            for shape in [(), (0,), (1,), (13,), (70_001,)]:
                x = cp.asarray(make(pg.rank, shape, dtype, seed=src))
                pg.broadcast(x, src)
                np.testing.assert_array_equal(host(x), make(src, shape, dtype, seed=src))
        for dtype, op in REDUCTIONS["broadcast_reduce"]:
            for shape in [(), (7,), (50_000,)]:
                x = cp.asarray(make(pg.rank, shape, dtype, seed=src))
                pg.reduce(x, src, op)
                assert x.shape == shape
                if pg.rank == src:
                    expected = reference([make(r, shape, dtype, seed=src) for r in range(n)], op)
                    np.testing.assert_array_equal(host(x), expected)


def case_all_gather_and_reduce_scatter(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    for dtype in ("float32", "int8", "bool", "float64", "int16"):
        for shape in [(), (0,), (1,), (3, 5), (100_003,)]:
            got = pg.all_gather(cp.asarray(make(pg.rank, shape, dtype)))
            assert got.shape == (n, *shape)
            np.testing.assert_array_equal(host(got), np.stack([make(r, shape, dtype) for r in range(n)]))
    for dtype, op in REDUCTIONS["gather_scatter"]:
        for rows, tail in [(1, ()), (3, (5,)), (7, ()), (40_001, ())]:
            inputs = [make(r, (n * rows, *tail), dtype) for r in range(n)]
            why = nccl_refusal(dtype, op)
            if why is not None:  # integer AVG: refused by the rule every backend shares
                with pytest.raises(TypeError, match=why):
                    pg.reduce_scatter(cp.asarray(inputs[pg.rank]), op)
                continue
            got = pg.reduce_scatter(cp.asarray(inputs[pg.rank]), op)
            np.testing.assert_array_equal(host(got), reference(inputs, op)[pg.rank * rows : (pg.rank + 1) * rows])
    if n > 1:
        with pytest.raises(ValueError, match="divisible by the group size"):
            pg.reduce_scatter(cp.ones(n + 1, cp.float32))
    # out= (as FSDP and tensor parallel pass it): a CuPy buffer is filled in place, a NumPy one through staging
    x = make(pg.rank, (4, 3), "float32")
    want = np.stack([make(r, (4, 3), "float32") for r in range(n)])
    for out in (cp.empty((n, 4, 3), cp.float32), np.empty((n, 4, 3), np.float32)):
        for async_op in (False, True):
            got = pg.all_gather(cp.asarray(x), out=out, async_op=async_op)
            got = got.result() if async_op else got
            assert got is out
            np.testing.assert_array_equal(host(out), want)
    inputs = [make(r, (4 * n, 3), "float32") for r in range(n)]
    rs = cp.empty((4, 3), cp.float32)
    assert pg.reduce_scatter(cp.asarray(inputs[pg.rank]), ReduceOp.SUM, out=rs) is rs
    np.testing.assert_array_equal(host(rs), reference(inputs, ReduceOp.SUM)[pg.rank * 4 : (pg.rank + 1) * 4])
    with pytest.raises(ValueError, match="out= must be a float32 array of shape"):
        pg.all_gather(cp.asarray(x), out=cp.empty((n + 1, 4, 3), cp.float32))


def case_gather_scatter_all_to_all(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    for root in range(n):
        for shape in [(), (6,), (2, 3)]:
            got = pg.gather(cp.asarray(make(pg.rank, shape, "float32", seed=root)), root)
            if pg.rank == root:
                np.testing.assert_array_equal(host(got), np.stack([make(r, shape, "float32", seed=root)
                                                                   for r in range(n)]))
            else:
                assert got is None
            tail = () if shape == () else (12,)
            full = np.arange(n * int(np.prod(tail)), dtype=np.int16).reshape(n, *tail)
            got = pg.scatter(cp.asarray(full) if pg.rank == root else None, root)
            assert got.dtype == full.dtype
            np.testing.assert_array_equal(host(got), full[pg.rank])
    for rows in (1, 3, 20_000):
        inputs = [np.arange(n * rows * 2, dtype=np.float64).reshape(n * rows, 2) + 1000 * r for r in range(n)]
        got = pg.all_to_all(cp.asarray(inputs[pg.rank]))
        r = pg.rank
        np.testing.assert_array_equal(host(got), np.concatenate([inputs[s][r * rows : (r + 1) * rows]
                                                                 for s in range(n)]))
    splits = np.arange(n * n).reshape(n, n) % 3  # splits[s, d]: rows s sends to d (some empty)
    r = pg.rank
    inputs = [np.arange(int(splits[s].sum()) * 2, dtype=np.float16).reshape(-1, 2) + 100 * s for s in range(n)]
    for outs in (list(splits[:, r]), None):  # given, and asked from the peers
        got = pg.all_to_all(cp.asarray(inputs[r]), input_split_sizes=list(splits[r]), output_split_sizes=outs)
        want = np.concatenate([inputs[s][splits[s, :r].sum() : splits[s, : r + 1].sum()] for s in range(n)])
        np.testing.assert_array_equal(host(got), want)


def case_send_recv_ring(pg: ProcessGroup) -> None:
    cp, n, me = cupy_module(), pg.size, pg.rank
    for tag, size in ((0, 1), (7, 100_000), (3, 0)):
        x = cp.full(size, me * 10 + tag, cp.int64)
        y = cp.empty(size, cp.int64)
        if me % 2 == 0:
            pg.send(x, (me + 1) % n, tag)
            pg.recv(y, (me - 1) % n, tag)
        else:
            pg.recv(y, (me - 1) % n, tag)
            pg.send(x, (me + 1) % n, tag)
        assert (host(y) == ((me - 1) % n) * 10 + tag).all()


def case_batch_isend_irecv_ring(pg: ProcessGroup) -> None:
    """Receives listed before sends on every rank: one NCCL group, so no deadlock."""
    cp, n, me = cupy_module(), pg.size, pg.rank
    got = cp.empty((2, 1 << 20), cp.float32)
    mine = cp.full(1 << 20, me, cp.float32)
    left, right = pg.global_rank_of((me - 1) % n), pg.global_rank_of((me + 1) % n)
    works = axond.batch_isend_irecv([axond.P2POp(axond.irecv, got[0], left, pg, 1),
                                     axond.P2POp(axond.irecv, got[1], right, pg, 2),
                                     axond.P2POp(axond.isend, mine, right, pg, 1),
                                     axond.P2POp(axond.isend, mine + 100, left, pg, 2)])
    for w in works:
        w.wait()
    assert (host(got[0]) == (me - 1) % n).all() and (host(got[1]) == (me + 1) % n + 100).all()


def case_barrier_small_ops_and_async(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    x = cp.zeros(1, cp.int64)
    for i in range(200):
        x[0] = i
        pg.all_reduce(x, ReduceOp.MAX)
        assert int(x[0]) == i
        if i % 50 == 0:
            pg.barrier()
    y = cp.full(1000, pg.rank + 1, cp.float32)
    work = pg.all_reduce(y, ReduceOp.SUM, async_op=True)
    assert work is not None
    work.wait()
    assert (host(y) == n * (n + 1) / 2).all()
    backend = pg.backend
    assert isinstance(backend, NcclBackend)
    z = cp.full(10, pg.rank, cp.float64)
    launched = backend.start("all_gather", z)
    gathered = launched.result()  # ordered on the current stream; the host waits only in synchronize()
    assert launched.synchronize() and launched.is_completed() and launched.is_success()
    np.testing.assert_array_equal(host(gathered), np.repeat(np.arange(n, dtype=np.float64)[:, None], 10, axis=1))


def case_numpy_arrays_are_staged_through_the_gpu(pg: ProcessGroup) -> None:
    n = pg.size
    x = np.full(5, pg.rank + 1, np.float32)
    pg.all_reduce(x, ReduceOp.SUM)
    assert isinstance(x, np.ndarray) and (x == n * (n + 1) / 2).all()
    got = pg.all_gather(np.full(3, pg.rank, np.int32))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=np.int32)[:, None], 3, axis=1))


def case_subgroups_get_their_own_communicators(pg: ProcessGroup) -> None:
    cp, n = cupy_module(), pg.size
    pair = pg.new_group([0, 1])
    rest = pg.new_group(list(range(1, n)))
    x = cp.full(4, pg.rank + 1, cp.int32)
    if pair.rank >= 0:
        pair.all_reduce(x, ReduceOp.SUM)
        assert (host(x) == 3).all()
    y = cp.full(4, pg.rank, cp.int32)
    if rest.rank >= 0:
        rest.all_reduce(y, ReduceOp.MAX)
        assert (host(y) == n - 1).all()
    pg.barrier()
    for g in (pair, rest):
        g.destroy()


def case_mismatched_split_sizes_raise_on_both_ranks(pg: ProcessGroup) -> None:
    """Rank 0 sends 2 rows to rank 1, which expects 1: the count exchange raises on both, before any data moves."""
    cp = cupy_module()
    pair = pg.new_group([0, 1])  # every rank calls new_group; only the pair runs the op
    if pg.rank > 1:
        return
    x = cp.ones((3, 2), cp.float32)
    ins, outs = ([1, 2], [1, 2]) if pg.rank == 0 else ([2, 1], [1, 1])
    with pytest.raises(DistributedError, match="disagree on the split sizes of all_to_all") as info:
        pair.all_to_all(x, input_split_sizes=ins, output_split_sizes=outs)
    assert (info.value.op, info.value.peer) == ("all_to_all", 1 - pg.rank)
    pair.destroy()


def case_mismatched_tag_fails_cleanly(pg: ProcessGroup) -> None:
    """The receiver reads the header first: a wrong tag is an error there, not a hang or corrupt data.

    Whether rank 0's small send completes is up to NCCL's buffering; what is certain is that rank 1
    aborted its communicator, so rank 0's next collective must fail within its timeout.
    """
    cp = cupy_module()
    if pg.rank == 0:
        try:
            pg.send(cp.ones(8, cp.float32), 1, tag=1)
        except DistributedError:
            pass
        with pytest.raises(DistributedError):
            pg.barrier()
    elif pg.rank == 1:
        with pytest.raises(DistributedError, match=r"tag 1 \(expected 2\)") as info:
            pg.recv(cp.empty(8, cp.float32), 0, tag=2)
        assert (info.value.op, info.value.peer) == ("recv", 0)
        with pytest.raises(DistributedError, match="aborted"):
            pg.barrier()


def case_hung_peer_is_aborted_by_the_watchdog(pg: ProcessGroup) -> None:
    """Rank 1 never joins the all_reduce and exits; rank 0's op must fail after its timeout, not hang."""
    cp = cupy_module()
    if pg.rank != 0:
        time.sleep(pg.options.timeout + 5)
        os._exit(0)
    started = time.monotonic()
    with pytest.raises(DistributedError, match="did not complete|asynchronous error") as info:
        pg.all_reduce(cp.ones(1 << 20, cp.float32), ReduceOp.SUM)
    assert time.monotonic() - started < pg.options.timeout + 10
    assert (info.value.op, info.value.rank) == ("all_reduce", 0)
    with pytest.raises(DistributedError, match="aborted"):
        pg.barrier()
    os._exit(0)


def case_abort_fails_the_peers(pg: ProcessGroup) -> None:
    """The last rank aborts its communicator (ProcessGroup.abort) instead of joining an all_reduce: the others
    raise DistributedError (NCCL's remote error or the watchdog), bounded by the timeout, and do not hang."""
    cp = cupy_module()
    if pg.rank == pg.size - 1:
        time.sleep(1.0)
        pg.abort("rank failed outside a collective")
        with pytest.raises(DistributedError):
            pg.barrier()
        os._exit(0)
    started = time.monotonic()
    with pytest.raises(DistributedError):
        pg.all_reduce(cp.ones(1 << 20, cp.float32), ReduceOp.SUM)
    assert time.monotonic() - started < pg.options.timeout + 10
    os._exit(0)


CASES: dict[str, Callable[[ProcessGroup], None]] = {
    "all_reduce": case_all_reduce,
    "random_floats": case_random_floats_agree_bitwise,
    "non_contiguous": case_non_contiguous_in_place,
    "broadcast_reduce": case_broadcast_and_reduce,
    "gather_scatter": case_all_gather_and_reduce_scatter,
    "p2p_patterns": case_gather_scatter_all_to_all,
    "small_ops_async": case_barrier_small_ops_and_async,
    "numpy_staging": case_numpy_arrays_are_staged_through_the_gpu,
}
MULTI_ONLY: dict[str, tuple[Callable[[ProcessGroup], None], float]] = {
    "send_recv": (case_send_recv_ring, 60.0),
    "batch_p2p": (case_batch_isend_irecv_ring, 60.0),
    "subgroups": (case_subgroups_get_their_own_communicators, 60.0),
    "mismatched_tag": (case_mismatched_tag_fails_cleanly, 5.0),
    "mismatched_splits": (case_mismatched_split_sizes_raise_on_both_ranks, 10.0),
    "hung_peer": (case_hung_peer_is_aborted_by_the_watchdog, 3.0),
    "abort": (case_abort_fails_the_peers, 3.0),
}


def run_world(case: str, world_size: int, op_timeout: float = 60.0) -> None:
    """One process per GPU, each running CASES/MULTI_ONLY[case] on the default group."""
    if gpu_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs (NCCL refuses two ranks on one device); {gpu_count()} visible")
    here = Path(__file__).resolve().parent
    env = {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent / "helpers"), os.environ.get("PYTHONPATH", "")])}
    run_processes("test_nccl_gpu", world_size, timeout=op_timeout + 120, args=[case, str(op_timeout)], env=env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_world_of_one_in_process(case: str) -> None:
    pg = create_group(InMemoryStore(), 0, 1, "nccl", BackendOptions(timeout=30.0, device=0))
    try:
        CASES[case](pg)
    finally:
        pg.destroy()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(set(CASES) | set(MULTI_ONLY)))
def test_one_process_per_gpu(case: str, world_size: int) -> None:
    if case == "mismatched_tag" and world_size > 2:
        pytest.skip("the two ranks involved abort their communicator; bystanders would then destroy theirs")
    timeout = MULTI_ONLY[case][1] if case in MULTI_ONLY else 60.0
    run_world(case, world_size, timeout)


def test_auto_picks_nccl_where_it_can_run() -> None:
    assert resolve_backend("auto") == "gpu-auto"  # the members choose together: NCCL here (one rank, one GPU)
    pg = create_group(InMemoryStore(), 0, 1, "auto", BackendOptions(timeout=30.0, device=0))
    try:
        assert pg.backend_name == "nccl"
    finally:
        pg.destroy()


def test_clear_errors_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    cp = cupy_module()
    monkeypatch.setenv("LOCAL_RANK", str(gpu_count()))
    with pytest.raises(BackendUnavailable, match=f"LOCAL_RANK={gpu_count()} but {gpu_count()} CUDA device"):
        NcclBackend(InMemoryStore(), 0, 1, "world", BackendOptions(timeout=5.0))
    backend = NcclBackend(InMemoryStore(), 0, 1, "world", BackendOptions(timeout=30.0, device=0))
    try:
        with pytest.raises(TypeError, match="expected a CuPy"):
            backend.all_reduce([1.0, 2.0], ReduceOp.SUM)
        with pytest.raises(TypeError, match="16-bit integer"):
            backend.all_reduce(cp.ones(3, cp.int16), ReduceOp.SUM)
        with pytest.raises(ValueError, match="not a rank of group"):
            backend.broadcast(cp.ones(3), 1)
        if gpu_count() > 1:
            with cp.cuda.Device(1):
                elsewhere = cp.ones(3)
            with pytest.raises(ValueError, match="is on cuda:1"):
                backend.all_reduce(elsewhere, ReduceOp.SUM)
    finally:
        backend.close()


def _rank_main(argv: list[str]) -> int:
    """Entry of one rank process started by `run_world`: init from the environment, run the case."""
    import axond

    case, timeout = argv[0], float(argv[1])
    fn = CASES[case] if case in CASES else MULTI_ONLY[case][0]
    pg = axond.init_process_group("nccl", timeout=timeout)
    try:
        fn(pg)
    finally:
        axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
