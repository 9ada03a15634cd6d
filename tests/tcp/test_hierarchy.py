"""Groups spread over nodes: the topology every member derives, and the two-level all_reduce, broadcast, all_gather
and reduce_scatter (each node through its shared-memory arena, the nodes over the sockets), against NumPy
references, with failures and fallbacks.

Nodes are simulated on loopback: members that listen on and advertise 127.0.0.1 are one node, 127.0.0.2 another
(`axond.testing.node_hosts`); each node's members really share an arena, and the nodes really talk over sockets.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup, ReduceOp
from axond.distributed import BackendOptions, FileStore, create_group
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import TWO_LEVEL_STEP_BYTES
from axond.distributed.backends.tcp.shm.arena import ShmArena
from axond.distributed.backends.tcp.hierarchy.two_level import _member_rows
from axond.distributed.backends.tcp.hierarchy.topology import RECORD_BYTES, Topology, describe
from axond.distributed.backends.tcp.transport.wire import Op
from axond.testing import collect_from_processes, node_hosts, run_on, thread_groups
from collective_cases import all_reduce_until_killed, DTYPES, TRANSPORTS, make, reference, refused

SMALL_ARENA = TRANSPORTS["shm"]
"""Shared memory for every size, through a 64 KiB arena (many steps per op)."""
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]


def spread(size: int, nodes: int, timeout: float = 20.0, tcp: TcpOptions | list[TcpOptions | None] | None = SMALL_ARENA,
           ) -> list[ProcessGroup]:
    """A tcp group of `size` threads, rank r on node r % nodes, with `tcp` options (one per rank if a list)."""
    each = tcp if isinstance(tcp, list) else [tcp] * size
    return thread_groups(size, options=[BackendOptions(timeout=timeout, tcp=t) for t in each],
                         hosts=node_hosts(size, nodes))


def teams_of(pg: ProcessGroup) -> Any:
    return pg.backend.placement.levels  # type: ignore[union-attr]


def leftovers() -> list[str]:
    return glob.glob(f"/dev/shm/axond-{os.getpid()}-*")


def records(*members: tuple[str, int]) -> np.ndarray:
    return np.stack([describe(host, arena) for host, arena in members]) if members else np.zeros((0, RECORD_BYTES))


def test_topology_groups_members_by_address_in_rank_order() -> None:
    t = Topology.parse(records(("10.0.0.2", 1), ("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.1", 1)))
    assert t.nodes == ((0, 2), (1, 3)) and t.per_node == 2 and t.same_settings
    assert t.node_of(3) == (1, 3) and t.counterparts(3) == (2, 3) and t.counterparts(0) == (0, 1)
    uneven = Topology.parse(records(("a", 1), ("b", 1), ("a", 1)))
    assert uneven.nodes == ((0, 2), (1,)) and uneven.per_node == 0
    assert Topology.parse(records(("a", 1), ("a", 2))).same_settings is False
    assert Topology.parse(records(("a" * 80, 1), ("a" * 56 + "b", 1))).nodes == ((0, 1),)  # only the first 56 bytes


@pytest.fixture(scope="module", params=[(4, 2), (6, 2), (6, 3)], ids=lambda p: f"{p[0]}ranks-{p[1]}nodes")
def spread_groups(request: pytest.FixtureRequest) -> Iterator[list[ProcessGroup]]:
    gs = spread(*request.param)
    yield gs
    for g in gs:
        g.destroy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (13,), (4, 7), (40_009,)])
def test_every_dtype_and_op_matches_numpy(spread_groups: list[ProcessGroup], dtype: str,
                                          shape: tuple[int, ...]) -> None:
    n = len(spread_groups)
    ops = [op for op in OPS if not refused(dtype, op)]
    inputs = {op: [make(r, shape, dtype, seed=k) for r in range(n)] for k, op in enumerate(ops)}

    def body(pg: ProcessGroup) -> list[np.ndarray]:
        out = []
        for op in ops:
            x = inputs[op][pg.rank].copy()
            pg.all_reduce(x, op)
            out.append(x)
        return out

    for got in run_on(spread_groups, body):
        for op, x in zip(ops, got):
            np.testing.assert_array_equal(x, reference(inputs[op], op), err_msg=f"{op} {dtype} {shape}")
    assert all(teams_of(pg) is not None and pg.backend.placement.arena is None for pg in spread_groups)  # type: ignore[union-attr]


@pytest.mark.slow  # many rank processes or deadlines waited out: the full run, not the quick loop
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (13,), (4, 7), (20_011,)])
def test_broadcast_all_gather_and_reduce_scatter_match_numpy(spread_groups: list[ProcessGroup], dtype: str,
                                                             shape: tuple[int, ...]) -> None:
    """Rows land in group rank order although each node's members are not consecutive ranks (r % nodes)."""
    n = len(spread_groups)
    ops = [op for op in OPS if not refused(dtype, op)]
    rows = (n * shape[0], *shape[1:])
    inputs = [make(r, shape, dtype) for r in range(n)]
    scatter_in = {op: [make(r, rows, dtype, seed=k) for r in range(n)] for k, op in enumerate(ops)}

    def body(pg: ProcessGroup) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
        sent = []
        for root in range(n):
            x = inputs[pg.rank].copy()
            pg.broadcast(x, root)
            sent.append(x)
        return sent, pg.all_gather(inputs[pg.rank]), [pg.reduce_scatter(scatter_in[op][pg.rank], op) for op in ops]

    for r, (sent, gathered, scattered) in enumerate(run_on(spread_groups, body)):
        for root, x in enumerate(sent):
            np.testing.assert_array_equal(x, inputs[root], err_msg=f"broadcast from {root} on rank {r}")
        np.testing.assert_array_equal(gathered, np.stack(inputs), err_msg=f"all_gather on rank {r}")
        for op, got in zip(ops, scattered):
            want = reference(scatter_in[op], op)[r * shape[0] : (r + 1) * shape[0]]
            np.testing.assert_array_equal(got, want, err_msg=f"reduce_scatter {op} on rank {r}")


def test_nodes_of_consecutive_ranks_as_a_launcher_places_them() -> None:
    """Ranks 0-2 on one node and 3-5 on another (torchrun's and axond worker's layout)."""
    gs = thread_groups(6, options=BackendOptions(timeout=20.0, tcp=SMALL_ARENA), hosts=["127.0.0.1"] * 3 + ["127.0.0.2"] * 3)
    try:
        def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            x = np.arange(30_000, dtype=np.float64) * (pg.rank + 1)
            pg.all_reduce(x)
            b = np.full(9_999, pg.rank, np.int32)
            pg.broadcast(b, 4)
            return x, b, pg.all_gather(np.full(3, pg.rank)), pg.reduce_scatter(np.arange(6 * 1000.0) + pg.rank)
        for r, (x, b, gathered, block) in enumerate(run_on(gs, body)):
            np.testing.assert_array_equal(x, np.arange(30_000, dtype=np.float64) * 21)
            assert (b == 4).all() and (gathered == np.arange(6)[:, None]).all()
            np.testing.assert_array_equal(block, 6 * np.arange(r * 1000.0, (r + 1) * 1000.0) + 15)
        assert [teams_of(pg).local.members for pg in gs] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3
        assert [teams_of(pg).across.members for pg in gs] == [(0, 3), (1, 4), (2, 5)] * 2
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("layout", [
    ["127.0.0.1", "127.0.0.2"] * 3,  # round robin: each member's rows contiguous, gathered in place
    ["127.0.0.1"] * 3 + ["127.0.0.2"] * 3,  # consecutive, two nodes: rows a stride apart, in place
    ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2,  # consecutive, three nodes: the ring needs scratch
    ["127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.1"],  # neither: through scratch, then reordered
], ids=["round-robin", "consecutive-2", "consecutive-3", "scrambled"])
def test_all_gather_puts_every_row_in_rank_order_in_any_layout(layout: list[str]) -> None:
    n = len(layout)
    gs = thread_groups(n, options=BackendOptions(timeout=20.0, tcp=SMALL_ARENA), hosts=layout)
    try:
        def body(pg: ProcessGroup) -> np.ndarray:
            return pg.all_gather(np.arange(20_001, dtype=np.int32) + 100_000 * pg.rank)

        want = np.arange(20_001, dtype=np.int32) + 100_000 * np.arange(n)[:, None]
        for got in run_on(gs, body):
            np.testing.assert_array_equal(got, want)
        assert teams_of(gs[0]) is not None
    finally:
        for g in gs:
            g.destroy()


def test_member_rows_are_views_where_the_layout_allows() -> None:
    rows = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4)
    consecutive = _member_rows(rows, ((0, 1, 2), (3, 4, 5)))
    assert consecutive is not None and np.shares_memory(consecutive, rows)
    assert [[int(consecutive[i, j, 0]) // 4 for j in range(2)] for i in range(3)] == [[0, 3], [1, 4], [2, 5]]
    robin = _member_rows(rows, ((0, 2, 4), (1, 3, 5)))
    assert robin is not None and robin[1].flags.c_contiguous and [int(v) // 4 for v in robin[1, :, 0]] == [2, 3]
    assert _member_rows(rows, ((0, 3, 4), (1, 2, 5))) is None


def test_teams_are_each_node_and_each_index_across_nodes() -> None:
    gs = spread(6, 3)
    try:
        run_on(gs, lambda pg: pg.all_reduce(np.ones(1000)))
        for pg in gs:
            levels = teams_of(pg)
            assert levels.local.members == tuple(r for r in range(6) if r % 3 == pg.rank % 3)
            assert levels.across.members == (tuple(range(3)) if pg.rank < 3 else tuple(range(3, 6)))
            assert levels.arena is not None  # the node's; across the nodes is sockets only
        assert leftovers() == []  # each node's arena file was unlinked once its members mapped it
    finally:
        for g in gs:
            g.destroy()


def test_non_contiguous_floats_are_identical_on_every_rank_and_every_run() -> None:
    """Each part is reduced on its node in node order, then across the nodes: every rank gets the same bits."""
    gs = spread(4, 2)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((3, 50_001)).astype(np.float32) for _ in range(4)]
    try:
        def body(pg: ProcessGroup) -> list[np.ndarray]:
            outs = []
            for _ in range(2):
                x = inputs[pg.rank].copy()
                view = x[:, ::2]  # not contiguous: reduced through a contiguous copy
                pg.all_reduce(view)
                outs.append(view.copy())
            return outs
        got = run_on(gs, body)
        first = got[0][0]
        assert all(np.array_equal(o, first) for outs in got for o in outs)
        np.testing.assert_allclose(first, sum(i[:, ::2] for i in inputs), rtol=1e-5, atol=1e-5)
    finally:
        for g in gs:
            g.destroy()


def test_each_node_moves_a_mebibyte_per_step_of_its_default_arena() -> None:
    """With the default arena (4 MiB slots for two members per node), every op moves TWO_LEVEL_STEP_BYTES per step on
    its node (the buffers alternate per step, so the arena's turn tells the count) and matches NumPy."""
    gs = spread(4, 2, tcp=TcpOptions())
    count = 3 * TWO_LEVEL_STEP_BYTES // 8 + 1  # int64: four steps of an all_reduce, one of a whole slot
    try:
        def body(pg: ProcessGroup) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
            x = np.arange(count, dtype=np.int64) * (pg.rank + 1)
            pg.all_reduce(x)
            turn = teams_of(pg).arena.turn
            b = np.arange(count, dtype=np.int64) if pg.rank == 3 else np.zeros(count, np.int64)
            pg.broadcast(b, 3)
            gathered = pg.all_gather(np.full(count // 4, pg.rank, np.int64))
            scattered = pg.reduce_scatter(np.arange(4 * (count // 4), dtype=np.int64) + pg.rank)
            return x, turn, b, gathered, scattered

        block = count // 4
        full = sum(np.arange(4 * block, dtype=np.int64) + r for r in range(4))
        for r, (x, turn, b, gathered, scattered) in enumerate(run_on(gs, body, timeout=60.0)):
            assert teams_of(gs[r]).arena.chunk == 4 << 20
            np.testing.assert_array_equal(x, np.arange(count, dtype=np.int64) * 10)
            assert turn == 0  # four steps (a whole slot: one)
            np.testing.assert_array_equal(b, np.arange(count, dtype=np.int64))
            np.testing.assert_array_equal(gathered, np.repeat(np.arange(4), block).reshape(4, block))
            np.testing.assert_array_equal(scattered, full[r * block : (r + 1) * block])
    finally:
        for g in gs:
            g.destroy()


UNEVEN = {
    "2+1": node_hosts(3, 2),  # rank r on node r % 2: (0, 2), (1,)
    "3+2": node_hosts(5, 2),  # (0, 2, 4), (1, 3)
    "2+1+1": node_hosts(4, 3),  # (0, 3), (1,), (2,)
    "3+1": ["127.0.0.1"] * 3 + ["127.0.0.2"],  # consecutive, as a launcher places them
}


@pytest.mark.parametrize("layout", UNEVEN, ids=list(UNEVEN))
def test_hosts_of_different_sizes_all_reduce_and_broadcast_through_their_leaders(layout: str) -> None:
    """Hosts of different sizes: all_reduce and broadcast in two levels (each host's arena, its first member across),
    exact in every op and from every root; all_gather and reduce_scatter stay on the sockets; every member gets the
    same bits."""
    hosts = UNEVEN[layout]
    n = len(hosts)
    gs = thread_groups(n, options=BackendOptions(timeout=20.0, tcp=SMALL_ARENA), hosts=hosts)
    ops = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.PRODUCT]
    inputs = {op: [make(r, (30_011,), "float64", seed=k) for r in range(n)] for k, op in enumerate(ops)}
    rng = np.random.default_rng(3)
    floats = [rng.standard_normal(20_000).astype(np.float32) for _ in range(n)]
    try:
        def body(pg: ProcessGroup) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
            reduced = []
            for op in ops:
                x = inputs[op][pg.rank].copy()
                pg.all_reduce(x, op)
                reduced.append(x)
            sent = []
            for root in range(n):
                b = np.full(12_345, pg.rank, np.int32)
                pg.broadcast(b, root)
                sent.append(b)
            f = floats[pg.rank].copy()
            pg.all_reduce(f)
            return reduced, sent, f, pg.all_gather(np.full(5_000, pg.rank)), pg.reduce_scatter(np.ones(n * 4_000))

        got = run_on(gs, body)
        for r, (reduced, sent, f, gathered, block) in enumerate(got):
            for op, x in zip(ops, reduced):
                np.testing.assert_array_equal(x, reference(inputs[op], op), err_msg=f"{op} on rank {r}")
            for root, b in enumerate(sent):
                assert (b == root).all(), f"broadcast from {root} on rank {r}"
            assert np.array_equal(f, got[0][2])  # the leaders' bits everywhere
            np.testing.assert_allclose(f, sum(floats), rtol=1e-5, atol=1e-5)
            assert (gathered == np.arange(n)[:, None]).all() and (block == n).all()
        nodes = {h: tuple(r for r in range(n) if hosts[r] == h) for h in dict.fromkeys(hosts)}
        for pg in gs:
            levels = teams_of(pg)
            assert levels is not None and not levels.even
            assert levels.local.members == nodes[hosts[pg.rank]]
            leaders = tuple(node[0] for node in nodes.values())
            assert (levels.across.members if pg.rank in leaders else None) == (leaders if pg.rank in leaders else None)
            assert (levels.arena is None) == (len(levels.local.members) == 1)
            route = pg.backend.route  # type: ignore[union-attr]
            assert [str(route(op, 1 << 20)) for op in (Op.ALL_REDUCE, Op.BROADCAST)] == ["two_level"] * 2
            assert [route(op, 1 << 20).path.value for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)] == ["sockets"] * 2
        assert leftovers() == []
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("size,nodes", [(3, 3), (4, 4)])
def test_one_member_per_node_stays_on_sockets(size: int, nodes: int) -> None:
    gs = spread(size, nodes)
    try:
        out = run_on(gs, lambda pg: (lambda x: pg.all_reduce(x) or x)(np.full(10_001, pg.rank + 1.0)))
        assert all((x == size * (size + 1) / 2).all() for x in out)
        assert all(teams_of(pg) is None and pg.backend.placement.arena is None for pg in gs)  # type: ignore[union-attr]
    finally:
        for g in gs:
            g.destroy()


def test_a_member_that_cannot_map_its_node_arena_keeps_every_node_on_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    attach, calls = ShmArena.attach, []

    def refused_once(*args: Any) -> ShmArena:
        calls.append(1)
        if len(calls) == 1:
            raise PermissionError(errno.EACCES, "Permission denied")
        return attach(*args)
    monkeypatch.setattr(ShmArena, "attach", staticmethod(refused_once))
    gs = spread(4, 2)
    try:
        out = run_on(gs, lambda pg: (lambda x: pg.all_reduce(x) or x)(np.full(10_001, pg.rank + 1.0)))
        assert len(calls) == 2 and all((x == 10.0).all() for x in out)
        assert all(teams_of(pg) is None for pg in gs)  # the node that did map its arena does not use it either
        assert leftovers() == []
    finally:
        for g in gs:
            g.destroy()


def test_different_arena_sizes_or_shm_off_keep_the_group_on_sockets() -> None:
    gs = spread(4, 2, tcp=[SMALL_ARENA] * 3 + [dataclasses.replace(SMALL_ARENA, shm_arena_bytes=128 << 10)])
    try:
        out = run_on(gs, lambda pg: (lambda x: pg.all_reduce(x) or x)(np.full(10_001, pg.rank + 1.0)))
        assert all((x == 10.0).all() for x in out) and all(teams_of(pg) is None for pg in gs)
    finally:
        for g in gs:
            g.destroy()
    gs = spread(4, 2, tcp=TRANSPORTS["sockets"])
    try:
        run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 20)))
        assert all(teams_of(pg) is None and not pg.backend.placement.arena_tried for pg in gs)  # type: ignore[union-attr]
    finally:
        for g in gs:
            g.destroy()


def test_small_ops_stay_on_sockets_and_the_first_large_one_sets_the_teams_up() -> None:
    gs = spread(4, 2, tcp=TcpOptions())  # defaults: 64 KiB threshold (or 256 KiB if crowded), twice for 2+ per node
    try:
        crowded = gs[0].backend.comm.oversubscribed  # type: ignore[union-attr]
        threshold = (256 << 10) if crowded else (64 << 10)
        run_on(gs, lambda pg: pg.all_reduce(np.ones(threshold // 8 - 1)))  # (gathers the topology: a node's arena
        assert all(teams_of(pg) is None and not pg.backend.placement.arena_tried for pg in gs)  # type: ignore[union-attr]
        # would take it from 4 KiB, synchronized through the mailbox; the teams synchronize over the sockets)
        run_on(gs, lambda pg: pg.all_gather(np.ones(threshold // 4 // 8)))  # all_gather counts its output
        assert all(teams_of(pg) is not None for pg in gs)
        b = run_on(gs, lambda pg: (lambda x: pg.broadcast(x, 3) or x)(np.full(threshold // 8, pg.rank, np.float64)))
        assert all((x == 3).all() for x in b)  # broadcast, below twice the threshold: over the sockets
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("size", [4, 3], ids=["even", "uneven"])
def test_mismatched_calls_raise_on_every_rank_naming_both_sides(size: int) -> None:
    gs = spread(size, 2, timeout=5.0)
    try:
        run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))  # the teams are up

        def body(pg: ProcessGroup) -> None:
            pg.all_reduce(np.ones((1 << 16) + (pg.rank == size - 1)))
        errors = run_on(gs, body, return_exceptions=True)
        assert all(isinstance(e, DistributedError) for e in errors), errors
        assert any("65537" in str(e) and "65536" in str(e) for e in errors), errors
    finally:
        for g in gs:
            g.destroy()


def test_a_silent_member_times_out_naming_it() -> None:
    gs = spread(4, 2, timeout=1.0)
    try:
        run_on(gs, lambda pg: pg.all_reduce(np.ones(1 << 16)))
        t0 = time.monotonic()
        errors = run_on(gs[:3], lambda pg: pg.all_reduce(np.ones(1 << 16)), return_exceptions=True)
        assert time.monotonic() - t0 < 3.0
        assert all(isinstance(e, DistributedError) and "all_reduce" in str(e) for e in errors), errors
        assert any("peer 3" in str(e) or "peer rank 3" in str(e) for e in errors), errors
    finally:
        for g in gs:
            g.destroy()


def _die_mid_stream(rank: int, size: int, store_dir: str, q: Any) -> None:
    """Processes on two simulated nodes (rank r on node r % 2); rank 1 kills itself after a few large all-reduces."""
    pg = create_group(FileStore(store_dir), rank, size, "tcp",
                      BackendOptions(timeout=5.0, host=node_hosts(size, 2)[rank]))
    all_reduce_until_killed(pg, np.ones(3_000_000, np.float32), 50, 3, q, lambda pg: teams_of(pg) is not None)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("size", [4, 3, 5], ids=["even", "2+1", "3+2"])
def test_a_killed_process_makes_every_other_raise_promptly(size: int) -> None:
    """Rank 1 (on hosts of different sizes: the leader of its host) dies in the middle of the all-reduces."""
    items, codes = collect_from_processes(_die_mid_stream, size, expect=size - 1)
    got = {r: (m, t, used) for r, m, t, used, _ in items}
    assert sorted(got) == [r for r in range(size) if r != 1]
    for msg, took, used in got.values():
        assert "all_reduce" in msg and took < 2.0 and used, msg
    assert codes[1] == -signal.SIGKILL
    assert all(glob.glob(f"/dev/shm/axond-{pid}-*") == [] for *_, pid in items)
