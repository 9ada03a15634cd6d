"""The staging path's CPU half: which path a GPU group takes (claims through a real store), the reusable host
buffers, and the staging backend over real tcp sockets with NumPy arrays, next to a plain tcp member (the CPU rank
of a mixed group). Device arrays on it need a GPU: tests/nccl_gpu/test_gpu_device.py."""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.nccl.auto import GpuAuto, announce, build
from axond.distributed.backends.nccl.placement import (
    DeviceClaim,
    choose_path,
    exchange_claims,
    local_claim,
    shared_device,
)
from axond.distributed.backends.nccl.staging import HostBuffers, StagingBackend, host_view, size_class
from axond.distributed.backends.tcp import TcpBackend
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import BackendUnavailable, DistributedError
from axond.store import InMemoryStore, PrefixStore


def claim(host: str = "h0", gpu: str = "", nccl: bool = True, why: str = "") -> DeviceClaim:
    return DeviceClaim(host, gpu, nccl, why)


def test_nccl_only_when_every_member_has_a_gpu_of_its_own() -> None:
    own = [claim("h0", "GPU-a"), claim("h0", "GPU-b"), claim("h1", "GPU-a")]  # same UUID on another host: its own
    assert choose_path(own).backend == "nccl"
    assert choose_path(own).reason == "each of the 3 ranks has a GPU of its own"
    shared = choose_path([claim("h0", "GPU-a"), claim("h0", "GPU-b"), claim("h0", "GPU-a")])
    assert shared.backend == "staging"
    assert "ranks 0 and 2 share GPU GPU-a on h0" in shared.reason and "NCCL refuses" in shared.reason
    cpu = choose_path([claim("h0", "GPU-a"), claim("h1", "", False, "no CUDA device visible")])
    assert (cpu.backend, cpu.reason) == ("staging", "rank 1 has no GPU (no CUDA device visible)")
    no_nccl = choose_path([claim("h0", "GPU-a", False, "CuPy has no NCCL"), claim("h0", "GPU-b")])
    assert (no_nccl.backend, no_nccl.reason) == ("staging", "NCCL cannot run on rank 0: CuPy has no NCCL")
    assert "stages device arrays" in announce("world", shared) and "NCCL" in announce("world", choose_path(own))


def test_claims_round_trip_and_a_rank_without_cupy_claims_no_gpu() -> None:
    c = DeviceClaim("boot-1", "GPU-5f", False, "why: \"quoted\"", 3)
    assert DeviceClaim.decode(c.encode()) == c
    mine = local_claim(None)
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert (mine.gpu, mine.nccl) == ("", False) and "CuPy is not installed" in mine.why
    assert mine.host


def test_more_ranks_than_gpus_share_them_instead_of_failing() -> None:
    """torchrun --nproc 2 on one GPU: LOCAL_RANK 1 claims GPU 0 (so the group stages); an explicit device does not."""
    assert [shared_device(None, lr, 1) for lr in ("0", "1", None)] == [0, 0, 0]
    assert shared_device(None, "3", 2) == 1 and shared_device(None, "1", 2) == 1
    with pytest.raises(BackendUnavailable, match="BackendOptions.device=2 but 2 CUDA device"):
        shared_device(2, "0", 2)
    with pytest.raises(BackendUnavailable):
        shared_device(None, "0", 0)


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """`fn(rank)` in one thread per rank; their results, or the first error raised."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish"
    if errors:
        raise errors[0]
    return out


def test_every_member_reads_every_claim_and_a_new_incarnation_never_reads_stale_ones() -> None:
    store = InMemoryStore()
    mine = [claim("h0", f"GPU-{r}") for r in range(3)]
    first = run_ranks(3, lambda r: exchange_claims(store, r, 3, mine[r], 10.0, group_name="g"))
    assert first == [mine] * 3
    again = [claim("h0", "GPU-0")] * 3  # the group re-created with all ranks on one GPU
    second = run_ranks(3, lambda r: exchange_claims(store, r, 3, again[r], 10.0, group_name="g"))
    assert second == [again] * 3 and choose_path(second[0]).backend == "staging"


def test_a_member_that_never_says_which_device_it_uses_is_named() -> None:
    with pytest.raises(DistributedError, match=r"gpu init: group 'g' rank 0 waited 0.2s for rank 1") as e:
        exchange_claims(InMemoryStore(), 0, 2, claim("h0", "GPU-0"), 0.2, group_name="g")
    assert (e.value.op, e.value.peer) == ("gpu_init", 1)


def test_host_buffers_are_reused_only_after_their_copy_completed() -> None:
    assert [size_class(n) for n in (0, 1, 4096, 4097, 1 << 20)] == [4096, 4096, 4096, 8192, 1 << 20]
    buffers = HostBuffers(lambda n: np.zeros(n, np.uint8), keep_bytes=3 * 4096)

    class Copy:
        synced = 0

        def synchronize(self) -> None:
            Copy.synced += 1
    a = buffers.get(100)
    assert a.nbytes == 4096 and buffers.made == 1
    buffers.put(a, Copy())
    assert buffers.get(4000) is a and Copy.synced == 1, "the device copy that read it is waited for first"
    view = host_view(a, (3, 5), np.dtype("float64"))
    assert view.shape == (3, 5) and view.flags.c_contiguous and np.shares_memory(view, a)
    big = [buffers.get(4096) for _ in range(5)]
    for b in big:
        buffers.put(b)
    assert buffers.idle_bytes == 3 * 4096, "at most keep_bytes of idle buffers"


def group_options() -> BackendOptions:
    return BackendOptions(timeout=20.0, host="127.0.0.1")


def test_staging_and_plain_tcp_members_share_one_group() -> None:
    """A GPU rank stages through tcp; a CPU rank of the same group runs tcp itself: same wire, same results."""
    store = PrefixStore("pg/mixed", InMemoryStore())
    backends = run_ranks(3, lambda r: (StagingBackend if r < 2 else TcpBackend)(store, r, 3, "mixed", group_options()))
    try:
        def ops(r: int) -> dict[str, Any]:
            b = backends[r]
            x = np.full(1000, r + 1.0, np.float32)
            b.all_reduce(x, ReduceOp.SUM)
            y = np.arange(6, dtype=np.int64) * (r + 1)
            b.broadcast(y, 2)
            gathered = b.all_gather(np.full(2, r, np.int32))
            out = np.empty((3, 2), np.int32)
            b.all_gather(np.full(2, r, np.int32), out=out)
            got = b.scatter(np.arange(9, dtype=np.float64).reshape(3, 3) if r == 0 else None, 0)
            if r == 0:
                b.send(np.full(4, 7, np.int16), 1, tag=3)
            elif r == 1:
                z = np.empty(4, np.int16)
                b.recv(z, 0, tag=3)
                assert (z == 7).all()
            b.barrier()
            return {"x": x, "y": y, "gathered": gathered, "out": out, "scattered": got}
        results = run_ranks(3, ops)
    finally:
        for b in backends:
            b.close()
    for r, got in enumerate(results):
        assert (got["x"] == 6.0).all()
        np.testing.assert_array_equal(got["y"], np.arange(6) * 3)
        np.testing.assert_array_equal(got["gathered"], [[0, 0], [1, 1], [2, 2]])
        np.testing.assert_array_equal(got["out"], got["gathered"])
        np.testing.assert_array_equal(got["scattered"], np.arange(9, dtype=np.float64).reshape(3, 3)[r])


def test_start_runs_the_op_and_returns_a_completed_work() -> None:
    store = PrefixStore("pg/w", InMemoryStore())
    backends = run_ranks(2, lambda r: StagingBackend(store, r, 2, "w", group_options(), reason="test"))
    try:
        def op(r: int) -> Any:
            x = np.full(3, r + 1.0)
            work = backends[r].start("all_reduce", x, ReduceOp.SUM)
            assert work.wait() and work.synchronize() and work.is_completed() and work.is_success()
            return x
        assert all((x == 3.0).all() for x in run_ranks(2, op))
        assert backends[0].reason == "test" and backends[0].name == "staging"
    finally:
        for b in backends:
            b.close()


def test_auto_without_a_gpu_builds_tcp_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    store = PrefixStore("pg/world", InMemoryStore())
    with caplog.at_level(logging.WARNING, logger="axond"):
        backends = run_ranks(2, lambda r: build(store, r, 2, "world", group_options()))
    assert GpuAuto.is_available()[0] is (importlib.util.find_spec("cupy") is not None)
    try:
        assert all(isinstance(b, TcpBackend) for b in backends)
        said = [r.getMessage() for r in caplog.records if "stages device arrays" in r.getMessage()]
        assert len(said) == 1 and "rank 0 has no GPU" in said[0]

        def op(r: int) -> Any:
            x = np.full(2, r + 1)
            backends[r].all_reduce(x, ReduceOp.SUM)
            return x
        assert all((x == 3).all() for x in run_ranks(2, op))
    finally:
        for b in backends:
            b.close()
