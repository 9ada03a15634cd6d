"""Inputs and NumPy references shared by the collective contract suites of every backend (tcp, nccl)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from axond import DistributedError, ProcessGroup, ReduceOp, bfloat16
from axond.distributed import BackendOptions
from axond.distributed.backends.tcp import TcpOptions
from axond.testing import run_on, thread_groups

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
LOW_PRECISION = ["bfloat16"]
"""ml_dtypes' dtypes (NumPy has no bfloat16), checked on the tcp and mock backends (NCCL: test_nccl_support)."""
SHAPES = [(), (0,), (1,), (13,), (4, 7), (1031,), (40_009,)]
"""0-d, empty, one element, primes, 2-D, and one above the small-message threshold (for 4+ byte dtypes)."""


BITWISE_UFUNCS = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
ARITHMETIC = [op for op in ReduceOp if op not in BITWISE_UFUNCS]
INTEGRAL = [d for d in DTYPES if np.dtype(d).kind in "biu"]


def make(rank: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic per-rank input of small values (exact sums and products in every dtype)."""
    rng = np.random.default_rng([seed, rank, len(shape), int(np.prod(shape))])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    low = 0 if dtype.startswith("uint") else -3
    return rng.integers(low, 4, shape).astype(bfloat16 if dtype == "bfloat16" else dtype)


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """NumPy's reduction of `inputs`; bfloat16 reduces in float32 and rounds once, as the backends do
    (so bit-exact: small-integer sums and products are exact in float32 in any order, MIN/MAX exact anyway)."""
    if inputs[0].dtype == bfloat16:
        return reference([x.astype(np.float32) for x in inputs], op).astype(bfloat16)
    stack = np.stack(inputs)
    dtype = stack.dtype
    if op is ReduceOp.SUM:
        return np.add.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.PRODUCT:
        return np.multiply.reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.MIN:
        return np.minimum.reduce(stack, axis=0)
    if op is ReduceOp.MAX:
        return np.maximum.reduce(stack, axis=0)
    if op in BITWISE_UFUNCS:
        return BITWISE_UFUNCS[op].reduce(stack, axis=0)
    total = np.add.reduce(stack, axis=0, dtype=dtype)
    return np.true_divide(total, len(inputs)).astype(dtype)


def refused(dtype: str, op: ReduceOp) -> bool:
    """Whether the collectives refuse `op` on `dtype`: AVG on bool and integer arrays, bitwise ops on floats."""
    integral = dtype != "bfloat16" and np.dtype(dtype).kind in "biu"
    return (op is ReduceOp.AVG and integral) or (op in BITWISE_UFUNCS and not integral)


TRANSPORTS = {
    "auto": None,
    "sockets": TcpOptions(shm=False),
    "shm": TcpOptions(shm_min_bytes=0, shm_arena_bytes=64 << 10, shm_mailbox=False, shm_single_copy=False),
    "nodes": TcpOptions(shm_min_bytes=0, shm_arena_bytes=64 << 10),
    "spin": TcpOptions(shm_min_bytes=0, shm_arena_bytes=64 << 10, shm_single_copy=False),
    "single_copy": TcpOptions(shm_min_bytes=0, shm_mailbox=False),
    "mock": None,
}
"""How a test group of threads moves data: the defaults (small ops through the mailbox, large ones from
AXOND_SHM_MIN_BYTES through the single-copy path or the arena), sockets only (as between hosts), shared memory for
every op through a small arena (many steps per op, synchronized over the sockets; no mailbox), "spin": the same with
the mailbox (the steps synchronize through it), "single_copy": every op on the single-copy path (each rank reads its
peers' buffers; published and synchronized over the sockets), or "nodes": the same arena settings with rank r on
simulated node r % 2 (`node_hosts`), so 4 ranks run large ops in two levels. "mock" is not a tcp transport but the network-free
backend of that name (`axond.distributed.backends.mock`), held to the same contract."""
NODES = 2


def backend_of(transport: str) -> str:
    """The backend a test group on `transport` (a key of TRANSPORTS) uses."""
    return "mock" if transport == "mock" else "tcp"


def transport_options(transport: str, timeout: float, oversubscribed: bool | None = None) -> BackendOptions:
    """The options of a test group on `transport` (a key of TRANSPORTS); `oversubscribed` overrides whether the tcp
    backends think this host's ranks outnumber its cores (it picks algorithms)."""
    tcp = TRANSPORTS[transport]
    if oversubscribed is not None:
        tcp = dataclasses.replace(tcp or TcpOptions.from_env(), oversubscribed=oversubscribed)
    return BackendOptions(timeout=timeout, tcp=tcp)


EVERY_TRANSPORT = ([(n, "auto") for n in (1, 2, 3, 4)] + [(n, t) for t in ("sockets", "shm", "spin", "single_copy")
                                                            for n in (2, 3, 4)]
                   + [(n, "mock") for n in (1, 2, 3, 4)])
"""(world size, transport) of the groups the collective contract suite runs on."""


def on_backend(make: Callable[..., list[ProcessGroup]], backend: str) -> Callable[..., list[ProcessGroup]]:
    """conftest's `make_groups` forming groups of `backend`: "tcp" as asked, "mock" whatever the transport."""
    if backend == "tcp":
        return make
    return lambda n, timeout=1.0, crowded=None, transport="auto": make(n, timeout, transport="mock")


def group_members(size: int, transport: str) -> Iterator[list[ProcessGroup]]:
    """Fixture body: the members of a group of `size` threads (20 s timeout) on `transport`, destroyed after."""
    gs = thread_groups(size, options=transport_options(transport, 20.0), backend=backend_of(transport))
    yield gs
    for g in gs:
        g.destroy()


def all_reduce_until_killed(pg: ProcessGroup, x: np.ndarray, rounds: int, kill_at: int, q: Any,
                            used: Callable[[ProcessGroup], bool]) -> None:
    """Killed-process tests: all-reduce `x` `rounds` times; rank 1 SIGKILLs itself before round `kill_at`. Every
    other rank puts (rank, error message, seconds since its last completed op, `used(pg)`, pid) on `q`."""
    t0 = time.monotonic()
    try:
        for i in range(rounds):
            if pg.rank == 1 and i == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            pg.all_reduce(x)
            t0 = time.monotonic()
        q.put((pg.rank, "no error", 0.0, False, os.getpid()))
    except DistributedError as e:
        q.put((pg.rank, str(e), time.monotonic() - t0, used(pg), os.getpid()))
    pg.destroy()


def every_large_op(pg: ProcessGroup) -> dict[str, Any]:
    """Rank processes' body: a large all_reduce (AVG), broadcast, all_gather and reduce_scatter (MAX) on `pg`."""
    r, n = pg.rank, pg.size
    x = np.arange(1_000_003, dtype=np.float64) + r
    pg.all_reduce(x, ReduceOp.AVG)
    y = np.full(300_001, r, np.int32) if r != 1 else np.arange(300_001, dtype=np.int32)
    pg.broadcast(y, 1)
    return {"avg": x, "bcast": y, "gather": pg.all_gather(np.full(200_000, r, np.uint8)),
            "scatter": pg.reduce_scatter(np.ones((n * 70_001, 2), np.int64) * (r + 1), ReduceOp.MAX),
            "pid": os.getpid()}


def check_every_large_op(out: list[dict[str, Any]]) -> None:
    """What `every_large_op` returns on 3 ranks, checked against NumPy."""
    assert len({got["pid"] for got in out}) == 3
    for got in out:
        np.testing.assert_array_equal(got["avg"], np.arange(1_000_003, dtype=np.float64) + 1.0)
        np.testing.assert_array_equal(got["bcast"], np.arange(300_001, dtype=np.int32))
        assert (got["gather"] == np.arange(3, dtype=np.uint8)[:, None]).all()
        assert (got["scatter"] == 3).all() and got["scatter"].shape == (70_001, 2)


def check_killed_rank_1(items: list[Any], codes: list[Any], size: int) -> dict[int, tuple[str, float, bool, int]]:
    """The survivors' reports of `all_reduce_until_killed` (rank 1 SIGKILLed): each raised within 2 s, naming
    rank 1 and the op, on the path it checks (`used`); by rank: (message, seconds, used, pid)."""
    got = {r: (m, t, used, pid) for r, m, t, used, pid in items}
    assert sorted(got) == [r for r in range(size) if r != 1]
    for msg, took, used, _ in got.values():
        assert "rank 1" in msg and "all_reduce" in msg, msg
        assert took < 2.0 and used
    assert codes[1] == -signal.SIGKILL
    return got


def check_other_call_raises(groups: list[ProcessGroup], count: int) -> None:
    """Rank 0 all-reduces `count` float32 while the others broadcast as many: every rank raises, naming both calls."""
    def other(pg: ProcessGroup) -> None:
        if pg.rank == 0:
            pg.all_reduce(np.ones(count, np.float32))
        else:
            pg.broadcast(np.ones(count, np.float32), 0)
    errors = run_on(groups, other, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "broadcast" in str(e) and "all_reduce" in str(e)
               for e in errors), errors
