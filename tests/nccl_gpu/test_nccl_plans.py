"""The NCCL backend's per-call bookkeeping, on the CPU: plan cache, event pool, argument checks, the watchdog's
O(1) records and `NcclWork`'s stream semantics; and the GPU suite's reductions against the shared CPU rule.

`NcclWork` is driven here by a real `Watchdog` and completion "events" that are `threading.Event`-backed objects
with CUDA's `done` attribute; the stand-in backend only records which events a caller's stream was ordered after
(what `cupy.cuda.Stream.wait_event` would do on the GPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from axond.distributed.backends.nccl.plans import PlanCache, Planned, Pool, check_out, check_peer, split_rows
from axond.distributed.backends.nccl.support import reduction_plan
from axond.distributed.backends.nccl.watchdog import Watchdog, WatchedOp
from axond.distributed.backends.nccl.work import NcclWork
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import DistributedError
from gpu_cases import REDUCTIONS, nccl_refusal

NEW = 22809
CONSTS = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5,
          "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9,
          "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3}
"""cupy.cuda.nccl's values of these constants."""


def make_cache() -> tuple[PlanCache, list[str]]:
    looked_up: list[str] = []

    def const(name: str) -> int:
        looked_up.append(name)
        return CONSTS[name]
    return PlanCache(const, NEW), looked_up


@pytest.mark.parametrize("case", sorted(REDUCTIONS))
def test_the_gpu_suite_expects_exactly_the_refusals_of_the_plan(case: str) -> None:
    """What tests/nccl_gpu/test_nccl_gpu.py asks of NCCL, answered by the CPU: a stale expectation fails here, in CI."""
    cache, _ = make_cache()
    for dtype, op in REDUCTIONS[case]:
        why = nccl_refusal(dtype, op)
        if why is None:
            plan = cache.reduction(np.dtype(dtype), op, 5)
            assert plan.count == 5 * (2 if dtype.startswith("complex") else 1), (dtype, op)
        else:
            with pytest.raises(TypeError, match=why):
                reduction_plan(np.dtype(dtype), op, NEW)
            with pytest.raises(TypeError, match=why):
                cache.reduction(np.dtype(dtype), op, 5)


def test_plans_are_computed_once_per_op_dtype_and_count() -> None:
    cache, looked_up = make_cache()
    f32 = np.dtype("float32")
    first = cache.reduction(f32, ReduceOp.AVG, 2)
    assert first == Planned(CONSTS["NCCL_FLOAT32"], CONSTS["NCCL_SUM"], 2, True, 4)
    for _ in range(1000):
        assert cache.reduction(f32, ReduceOp.AVG, 2) is first
    assert cache.misses == 1 and looked_up == ["NCCL_FLOAT32", "NCCL_SUM"]
    assert cache.reduction(f32, ReduceOp.AVG, 3).count == 3 and cache.misses == 2
    assert cache.reduction(np.dtype("complex64"), ReduceOp.SUM, 3) == Planned(7, 0, 6, False, 4)
    assert cache.reduction(np.dtype("bool"), ReduceOp.SUM, 3).nccl_op == CONSTS["NCCL_MAX"]
    assert cache.transfer(np.dtype("int16"), 10) == Planned(CONSTS["NCCL_UINT8"], -1, 20, False, 1)
    assert cache.transfer(np.dtype("float64"), 10) == Planned(CONSTS["NCCL_FLOAT64"], -1, 10, False, 8)
    misses = cache.misses
    with pytest.raises(TypeError, match="16-bit integer"):
        cache.reduction(np.dtype("int16"), ReduceOp.SUM, 1)
    assert cache.misses == misses, "a refusal is not cached: it raises every time"


def test_the_cache_is_bounded() -> None:
    cache = PlanCache(CONSTS.__getitem__, NEW, limit=8)
    for n in range(20):
        cache.transfer(np.dtype("float32"), n)
        assert len(cache) <= 8
    assert cache.transfer(np.dtype("float32"), 19).count == 19


def test_the_pool_reuses_objects_and_keeps_a_bounded_number() -> None:
    pool: Pool[object] = Pool(object, limit=2)
    a = pool.get()
    pool.put(a)
    assert pool.get() is a and pool.made == 1
    items = [pool.get() for _ in range(4)]
    for item in items:
        pool.put(item)
    assert len(pool) == 2 and pool.made == 5


def test_argument_checks_say_what_is_wrong() -> None:
    check_peer(3, 4, "world", "src", "broadcast")
    check_peer(np.int64(0), 4, "world", "src", "broadcast")
    for bad in (4, -1, 1.0, "0", None):
        with pytest.raises(ValueError, match=r"nccl broadcast: src=.* is not a rank of group 'world' \(size 4\)"):
            check_peer(bad, 4, "world", "src", "broadcast")
    assert split_rows((8, 3), 4, "reduce_scatter") == 8
    for shape in ((), (6, 3)):
        with pytest.raises(ValueError, match="divisible by the group size 4"):
            split_rows(shape, 4, "reduce_scatter")
    check_out((4, 3), np.dtype("float32"), (4, 3), np.dtype("float32"), "all_gather")
    with pytest.raises(ValueError, match=r"out= must be a float32 array of shape \(4, 3\); got float32 \(5, 3\)"):
        check_out((5, 3), np.dtype("float32"), (4, 3), np.dtype("float32"), "all_gather")
    with pytest.raises(ValueError, match="got float64"):
        check_out((4, 3), np.dtype("float64"), (4, 3), np.dtype("float32"), "all_gather")


class Event:
    """A completion event as the watchdog and NcclWork see a CUDA event: `done` says whether it fired."""

    def __init__(self) -> None:
        self.fired = threading.Event()

    @property
    def done(self) -> bool:
        return self.fired.is_set()


class Backend:
    """What NcclWork uses of NcclBackend: the group's name, its watchdog and the stream ordering (recorded)."""

    def __init__(self, tick: float = 0.01) -> None:
        self.group_name = "tp0"
        self.aborts = 0
        self.released: list[Any] = []
        self.ordered_after: list[Any] = []
        self._watchdog = Watchdog(group="tp0", rank=1, abort=self.abort, tick=tick,
                                  on_done=lambda op: self.released.append(op.event))

    def abort(self) -> None:
        self.aborts += 1

    def _order_current_stream(self, event: Any) -> None:
        self.ordered_after.append(event)

    def launch(self, op: str = "all_reduce", timeout: float = 5.0, finish: Any = None, value: Any = None,
               keep: tuple[Any, ...] = ()) -> tuple[NcclWork, Event]:
        event = Event()
        watched = WatchedOp(op, None, time.monotonic() + timeout, None, keep, event=event)
        self._watchdog.watch(watched)
        watched.recorded = True
        return NcclWork(self, watched, finish, value), event  # type: ignore[arg-type]


@pytest.fixture
def backend() -> Iterator[Backend]:
    b = Backend()
    try:
        yield b
    finally:
        b._watchdog.close()


def test_wait_orders_the_stream_and_returns_before_the_op_completes(backend: Backend) -> None:
    """torch's Work.wait() on CUDA: the caller's stream waits on the op's event; the host does not."""
    work, event = backend.launch(value="the device result")
    assert work.wait() is True and work.result() == "the device result"
    assert not event.done and not work.is_completed()
    assert backend.ordered_after == [event, event]
    event.fired.set()
    assert work.is_completed() and work.is_success()
    assert work.synchronize() is True
    assert backend.released == [event], "the completion event goes back to the pool once"
    assert work.synchronize() is True and backend.released == [event]


def test_synchronize_blocks_the_host_until_the_event_fires(backend: Backend) -> None:
    work, event = backend.launch()
    assert work.synchronize(timeout=0.02) is False, "still running: synchronize(timeout) gives up"
    threading.Timer(0.05, event.fired.set).start()
    assert work.synchronize() is True and event.done
    assert backend.ordered_after == [event]


def test_ops_finished_on_the_host_wait_there(backend: Backend) -> None:
    """NumPy results (copied back on the host) make wait() a host wait, then run the finish once."""
    calls: list[int] = []

    def finish() -> str:
        calls.append(1)
        return "host array"
    work, event = backend.launch(finish=finish)
    assert work.needs_host
    threading.Timer(0.05, event.fired.set).start()
    assert work.result() == "host array" and event.done and calls == [1]
    assert work.wait() is True and calls == [1]


def test_the_thread_retires_unwaited_ops_and_releases_their_events(backend: Backend) -> None:
    """Blocking calls drop their Work at once: the watchdog alone releases the buffers and the event."""
    keep = (np.zeros(3),)
    works = [backend.launch(keep=keep) for _ in range(50)]
    assert backend._watchdog.in_flight() == 50
    for _, event in works:
        event.fired.set()
    deadline = time.monotonic() + 5.0
    while backend._watchdog.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend._watchdog.in_flight() == 0 and len(backend.released) == 50
    assert all(w._watched.keep == () and w.is_completed() for w, _ in works)


def test_reap_retires_the_oldest_completed_ops_in_order_without_blocking() -> None:
    b = Backend(tick=60.0)  # the thread stays asleep: only reap retires
    try:
        works = [b.launch() for _ in range(6)]
        for _, event in works[:3]:
            event.fired.set()
        works[4][1].fired.set()  # completed out of order: stays until the ones before it are done
        assert b._watchdog.reap(limit=2) == 2 and b._watchdog.in_flight() == 4
        assert b._watchdog.reap() == 1 and b._watchdog.in_flight() == 3
        assert b._watchdog.reap() == 0
        assert b.released == [e for _, e in works[:3]]
    finally:
        b._watchdog.close()


def test_a_stuck_op_is_aborted_and_wait_synchronize_and_the_next_op_raise(backend: Backend) -> None:
    work, _ = backend.launch(timeout=0.1)
    deadline = time.monotonic() + 5.0
    while backend._watchdog.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.aborts == 1
    for call in (work.wait, work.synchronize, work.result):
        with pytest.raises(DistributedError, match=r"nccl all_reduce: group 'tp0' rank 1: it did not complete") as e:
            call()
        assert (e.value.op, e.value.group, e.value.rank) == ("all_reduce", "tp0", 1)
    assert work.is_completed() and not work.is_success() and isinstance(work.exception(), DistributedError)
    with pytest.raises(DistributedError, match="nccl broadcast: .*the communicator is aborted"):
        backend.launch("broadcast")
    assert backend.released == [] and backend.ordered_after == []
