"""ProcessGroup semantics: subgroups, membership, local vs global ranks, Work, and the seed-compatible aliases."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import axond
from axond import DistributedError, ProcessGroup, ReduceOp
from axond.distributed import BackendOptions
from axond.distributed.backends.registry import available_backends
from axond.testing import run_on, thread_groups
from axond.testing.waits import wait_until


@pytest.fixture(scope="module")
def quad() -> Iterator[list[ProcessGroup]]:
    gs = thread_groups(4, options=BackendOptions(timeout=10.0))
    yield gs
    for g in gs:
        g.destroy()


def test_group_attributes(quad: list[ProcessGroup]) -> None:
    g = quad[2]
    assert (g.rank, g.size, g.ranks, g.name, g.backend_name) == (2, 4, [0, 1, 2, 3], "world", "tcp")
    assert g.contains(3) and not g.contains(4)


def test_new_group_members_and_non_members(quad: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> tuple[int, list[int], object]:
        sub = pg.new_group([3, 1])
        try:
            if not sub.contains(pg.global_rank):
                with pytest.raises(DistributedError, match="is not a member"):
                    sub.all_reduce(np.zeros(1))
                return sub.rank, sub.ranks, None
            x = np.array([float(pg.global_rank)])
            sub.all_reduce(x)
            y = np.zeros(2, np.int32) + pg.global_rank
            sub.broadcast(y, src=1)
            return sub.rank, sub.ranks, (float(x[0]), int(y[0]), sub.group_rank(3), sub.global_rank_of(0))
        finally:
            sub.destroy()

    out = run_on(quad, body)
    assert out[0] == (-1, [1, 3], None) and out[2] == (-1, [1, 3], None)
    assert out[1] == (0, [1, 3], (4.0, 3, 1, 1))
    assert out[3] == (1, [1, 3], (4.0, 3, 1, 1))


def test_new_group_rejects_bad_ranks(quad: list[ProcessGroup]) -> None:
    with pytest.raises(ValueError, match=r"ranks \[7\] are not in group 'world'"):
        quad[0].new_group([0, 7])
    with pytest.raises(ValueError, match="distinct ranks"):
        quad[0].new_group([1, 1])


def test_a_subgroup_with_its_own_timeout_times_out_on_it(quad: list[ProcessGroup]) -> None:
    subs = run_on(quad, lambda pg: axond.new_group([0, 1], group=pg, timeout=0.5))
    try:
        assert subs[0].timeout == 0.5 and quad[0].timeout == 10.0
        started = time.monotonic()
        with pytest.raises(DistributedError, match=r"timed out after 0.5 s waiting for peer 1"):
            subs[0].all_reduce(np.zeros(1))  # rank 1 never comes
        assert time.monotonic() - started < 3.0
        with pytest.raises(ValueError, match="timeout must be positive seconds, got 0"):
            quad[0].new_group([0, 1], timeout=0)
    finally:
        for s in subs:
            s.destroy()


def test_rank_helpers_backend_and_availability(quad: list[ProcessGroup]) -> None:
    subs = run_on(quad, lambda pg: pg.new_group([3, 1]))
    try:
        sub = subs[3]
        assert axond.get_process_group_ranks(sub) == [1, 3]
        assert axond.get_global_rank(sub, 1) == 3 and axond.get_group_rank(sub, 1) == 0
        with pytest.raises(ValueError, match="group rank 2 is outside group"):
            axond.get_global_rank(sub, 2)
        with pytest.raises(ValueError):
            axond.get_group_rank(sub, 2)
        assert axond.get_backend(sub) == "tcp" and axond.get_backend(quad[0]) == "tcp"
        assert axond.is_available() is True
        assert axond.is_nccl_available() is ("nccl" in available_backends())
    finally:
        for s in subs:
            s.destroy()


def test_nested_subgroup_and_concurrent_groups(quad: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> float:
        pair = pg.new_group([0, 1]) if pg.global_rank < 2 else pg.new_group([2, 3])
        try:
            x = np.array([1.0])
            pair.all_reduce(x)
            pg.all_reduce(x)
            return float(x[0])
        finally:
            pair.destroy()

    # Ranks 0,1 create group "world/1[0,1]" while ranks 2,3 create "world/1[2,3]": distinct names, no clash.
    assert run_on(quad, body) == [8.0] * 4


def test_work_result_and_is_completed(quad: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> tuple[bool, np.ndarray, np.ndarray]:
        w1 = pg.reduce_scatter(np.arange(8, dtype=np.float64), ReduceOp.MAX, async_op=True)
        w2 = pg.gather(np.array([pg.rank]), 0, async_op=True)
        w3 = pg.barrier(async_op=True)
        assert w3 is not None and w3.wait(timeout=10.0)
        return w1.is_completed() and w2.is_completed(), w1.result(), w2.result()

    out = run_on(quad, body)
    for r, (done, rs, gathered) in enumerate(out):
        assert done
        np.testing.assert_array_equal(rs, [2 * r, 2 * r + 1])
        if r == 0:
            np.testing.assert_array_equal(gathered, [[0], [1], [2], [3]])
        else:
            assert gathered is None


def test_seed_aliases(quad: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> dict[str, object]:
        r = pg.rank
        out: dict[str, object] = {}
        out["sum"] = axond.all_reduce_sum(np.array([r + 1.0]), pg)[0]
        out["mean"] = axond.all_reduce_mean(np.array([r + 1.0]), pg)[0]
        out["min"] = axond.all_reduce_min(np.array([r + 1.0]), pg)[0]
        out["max"] = axond.all_reduce_max(np.array([r + 1.0]), pg)[0]
        out["product"] = axond.all_reduce_product(np.array([r + 1.0]), pg)[0]
        out["bcast"] = axond.broadcast_from(np.array([r]), pg, 2)[0]
        out["rs_sum"] = axond.reduce_scatter_sum(np.ones(8) * r, pg).tolist()
        out["rs_mean"] = axond.reduce_scatter_mean(np.ones(4) * r, pg).tolist()
        g = axond.gather_tensor(np.array([r]), pg)
        out["gather"] = None if g is None else g.ravel().tolist()
        out["scatter"] = axond.scatter_tensor(np.arange(4) * 10 if r == 0 else None, pg).tolist()
        grad = np.full((2, 3), float(r))
        assert axond.sync_gradient(grad, pg) is grad
        out["grad"] = grad[0, 0]
        gs = [np.full(3, float(r)), np.full((2, 2), 2.0 * r, np.float32), np.full(1, 10.0 * r)]
        axond.sync_gradients(gs, pg)
        out["grads"] = [float(a.ravel()[0]) for a in gs]
        out["ids"] = (axond.rank(pg), axond.world_size(pg), axond.is_main_process(pg))
        return out

    for r, o in enumerate(run_on(quad, body)):
        assert (o["sum"], o["mean"], o["min"], o["max"], o["product"]) == (10.0, 2.5, 1.0, 4.0, 24.0)
        assert o["bcast"] == 2
        assert o["rs_sum"] == [6.0, 6.0] and o["rs_mean"] == [1.5]
        assert o["gather"] == ([0, 1, 2, 3] if r == 0 else None)
        assert o["scatter"] == r * 10
        assert o["grad"] == 1.5 and o["grads"] == [1.5, 3.0, 15.0]
        assert o["ids"] == (r, 4, r == 0)


def test_world_object_on_an_explicit_group(quad: list[ProcessGroup]) -> None:
    def body(pg: ProcessGroup) -> tuple[int, int, list[int]]:
        world = axond.World(pg)
        sub = world.new_group([0, 1, 2])
        sub.destroy()
        return world.rank(), world.world_size(), sub.ranks

    assert run_on(quad, body)[3] == (3, 4, [0, 1, 2])


def test_destroy_is_idempotent() -> None:
    gs = thread_groups(2)
    for g in gs:
        g.destroy()
        g.destroy()
    with pytest.raises(DistributedError):
        gs[0].all_reduce(np.zeros(1))


def test_abort_makes_waiting_peers_raise_at_once_with_the_reason() -> None:
    """A rank failing outside any collective calls abort: a peer blocked in all_reduce raises quoting
    the reason within a second, not after its 20 s timeout, and later ops on the aborted group raise."""
    import time

    groups = thread_groups(3, options=BackendOptions(timeout=20.0))

    def body(pg: ProcessGroup) -> tuple[str, float]:
        start = time.monotonic()
        if pg.rank == 1:
            wait_until(lambda: groups[0].inflight == groups[2].inflight == "all_reduce", 10.0,
                       "the others in all_reduce")
            pg.abort("data loader crashed on rank 1")
            with pytest.raises(DistributedError, match="aborted"):
                pg.all_reduce(np.ones(4))
            return "aborted", time.monotonic() - start
        with pytest.raises(DistributedError) as info:
            pg.all_reduce(np.ones(1 << 16))
        return str(info.value), time.monotonic() - start

    try:
        results = run_on(groups, body, timeout=30.0)
    finally:
        for g in groups:
            g.destroy()
    for rank in (0, 2):
        message, seconds = results[rank]
        assert seconds < 5.0, f"rank {rank} waited {seconds:.1f} s"
        assert "all_reduce" in message and "group 'world'" in message, message
    assert any("data loader crashed on rank 1" in results[r][0] for r in (0, 2)), results
