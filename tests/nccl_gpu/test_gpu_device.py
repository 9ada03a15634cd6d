"""The GPU half of the stream semantics and of the staging path (their CPU halves: tests/nccl_gpu/test_nccl_plans.py,
tests/nccl_gpu/test_gpu_staging.py). Marked `gpu`: skipped, with the reason, where CuPy, a GPU and NCCL are not all
usable.

The blocking-call test holds the GPU with a kernel that spins until the host sets a flag in pinned memory: if the
call waited for the GPU on the host, the op could not still be running when the call returned (the kernel gives up
by itself after some seconds, so a failure never hangs the run).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup, create_group
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import DistributedError
from axond.store import InMemoryStore
from gpu_cases import need_nccl  # noqa: F401 - the fixture
from test_gpu_staging import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("need_nccl")]

SPIN = r"""
extern "C" __global__ void spin(const volatile int* flag, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
}
"""


def cupy_module() -> Any:
    import cupy

    return cupy


def hold_the_gpu(cp: Any) -> np.ndarray:
    """Queue the spinning kernel on the current stream; set the returned flag's [0] to 1 to release it."""
    mem = cp.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(mem, np.int32, 1)  # the view keeps the pinned memory alive
    flag[0] = 0
    cp.RawKernel(SPIN, "spin")((1,), (1,), (np.uint64(flag.ctypes.data), np.int64(20_000_000_000)))
    return flag


@pytest.mark.timeout(120)
def test_a_blocking_call_returns_while_the_gpu_is_busy_and_is_ordered_after_it() -> None:
    cp = cupy_module()
    pg = create_group(InMemoryStore(), 0, 1, "nccl", BackendOptions(timeout=60.0, device=0))
    try:
        x = cp.full(1 << 16, 3.0, cp.float32)
        flag = hold_the_gpu(cp)
        pg.all_reduce(x, ReduceOp.AVG)  # queued behind the spin; returns at once
        x *= 2  # queued after the op on the same stream: sees its result
        work: Any = pg.all_reduce(x, ReduceOp.SUM, async_op=True)  # an NcclWork
        assert not work.is_completed(), "the host waited for the GPU in a blocking call"
        other = cp.cuda.Stream(non_blocking=True)
        with other:
            work.wait()  # `other` waits on the device; the host does not
            y = x + 1
        assert not work.is_completed()
        flag[0] = 1
        assert work.synchronize() and work.is_completed() and work.is_success()
        other.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(y), np.full(1 << 16, 7.0, np.float32))
    finally:
        pg.destroy()


@pytest.mark.timeout(120)
def test_two_ranks_on_one_gpu_stage_cupy_arrays_through_tcp() -> None:
    cp = cupy_module()
    store = InMemoryStore()
    groups: list[ProcessGroup] = run_ranks(2, lambda r: create_group(
        store, r, 2, "auto", BackendOptions(timeout=30.0, device=0, host="127.0.0.1")))
    try:
        assert [g.backend_name for g in groups] == ["staging", "staging"]

        def ops(r: int) -> Any:
            g = groups[r]
            cp.cuda.Device(0).use()
            x = cp.full(1 << 18, r + 1.0, cp.float32)
            g.all_reduce(x, ReduceOp.SUM)
            y = cp.arange(12, dtype=cp.float64).reshape(3, 4)[:, ::2] * (r + 1)  # not contiguous
            g.all_reduce(y, ReduceOp.SUM)
            gathered = g.all_gather(cp.full(3, r, cp.int32))
            assert isinstance(gathered, cp.ndarray)
            cp.cuda.get_current_stream().synchronize()
            return cp.asnumpy(x), cp.asnumpy(y), cp.asnumpy(gathered)
        for x, y, gathered in run_ranks(2, ops):
            assert (x == 3.0).all()
            np.testing.assert_array_equal(y, np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2] * 3)
            np.testing.assert_array_equal(gathered, [[0, 0, 0], [1, 1, 1]])
    finally:
        for g in groups:
            g.destroy()


@pytest.mark.timeout(120)
def test_asking_for_nccl_on_a_shared_gpu_keeps_the_clear_message() -> None:
    store = InMemoryStore()

    def make(r: int) -> Any:
        try:
            return create_group(store, r, 2, "nccl", BackendOptions(timeout=30.0, device=0))
        except DistributedError as e:
            return e
    got = run_ranks(2, make)
    errors = [e for e in got if isinstance(e, DistributedError)]
    for g in got:
        if isinstance(g, ProcessGroup):
            g.destroy()
    assert errors and all("NCCL refuses two ranks of one group on the same GPU" in str(e) for e in errors)
