"""FSDP's CPU offload on a CPU-only machine: the NumPy no-op, and the offload bookkeeping itself.

NumPy models have nothing to offload to: `CPUOffload` must change no number and no byte. The GPU path's
bookkeeping (upload when stale, keep or drop the device copy, download the gradient, wait only when `.grad`
is read, count host and device bytes) is device-agnostic. Here it runs through `HostCopies`, which copies
between NumPy arrays when called, and through `DeferredCopies` below, whose copies finish only when a test
says so. Neither is the CUDA path: that one runs in tests/nccl_gpu/test_fsdp_offload_gpu.py, on a GPU.
Ranks are threads over the real TCP backend (or the mock backend where tracemalloc counts bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.optim import AdamW
from axond.parallel import memory_estimate
from axond.parallel.fsdp import FSDP, CPUOffload, ShardingStrategy, offload
from axond.parallel.fsdp.offload import HostCopies, HostShard, ShardOffload
from axond.parallel.fsdp.stats import MemoryStats
from axond.testing import run_threads
from parity_models import mlp, mlp_data

S = ShardingStrategy
STEPS = 3
PARAMS = CPUOffload(offload_params=True)
OPTIMIZER = CPUOffload(offload_optimizer=True)


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any], backend: str = "tcp") -> list[Any]:
    return run_threads(fn, world, 60.0, backend=backend, options=BackendOptions(timeout=20))


def train(g: ProcessGroup, **kwargs: Any) -> tuple[FSDP, AdamW, list[np.ndarray], dict[str, np.ndarray]]:
    """STEPS of AdamW on this rank's rows; the outputs of every step and the final full state dict."""
    fsdp = FSDP(mlp(0), group=g, wrap=lambda m: isinstance(m, nn.Linear), **kwargs)
    opt = AdamW(list(fsdp.parameters()), lr=1e-2)
    loss = nn.CrossEntropyLoss()
    outputs = []
    for step in range(STEPS):
        x, y = mlp_data(step, 4 * g.size)
        rows = slice(4 * g.rank, 4 * g.rank + 4)
        opt.zero_grad()
        out = fsdp(x[rows])
        outputs.append(out.copy())
        loss(out, y[rows])
        fsdp.backward(loss.backward())
        opt.step()
    return fsdp, opt, outputs, dict(fsdp.full_state_dict())


def assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """Bit for bit: offload moves the same values, and the optimizer does the same arithmetic on them."""
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(x, y)
    assert list(a[3]) == list(b[3])
    for k in a[3]:
        np.testing.assert_array_equal(a[3][k], b[3][k], err_msg=k)


@pytest.fixture
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[HostCopies]:
    """Make FSDP offload NumPy models through HostCopies (the bookkeeping, without a device); the copiers built."""
    built: list[HostCopies] = []

    def make(device: Any, pin_memory: bool) -> HostCopies:
        built.append(HostCopies())
        return built[-1]

    monkeypatch.setattr(offload, "copier_for", make)
    return built


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("cpu_offload", [PARAMS, OPTIMIZER, CPUOffload(True, True)], ids=["params", "optimizer", "both"])
def test_numpy_models_offload_nothing(cpu_offload: CPUOffload) -> None:
    def body(g: ProcessGroup) -> tuple[Any, Any, dict[str, int], dict[str, int]]:
        plain, off = train(g), train(g, cpu_offload=cpu_offload)
        assert all(u.offload is None and type(u.shard) is nn.Parameter for u in off[0].units)
        return plain, off, plain[0].memory_stats(plain[1]), off[0].memory_stats(off[1])

    for plain, off, plain_stats, off_stats in run_ranks(2, body):
        assert_same(plain, off)
        assert off_stats == plain_stats
        assert off_stats["offloaded"] == 0 and off_stats["device_current"] == off_stats["current"]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD])
@pytest.mark.parametrize("cpu_offload", [PARAMS, OPTIMIZER], ids=["params", "optimizer"])
def test_offload_bookkeeping_trains_bit_for_bit(host_copies: list[HostCopies], strategy: ShardingStrategy,
                                                cpu_offload: CPUOffload) -> None:
    """Through HostCopies: the same outputs and parameters as without offload, and the transfers FSDP promises:
    offload_params uploads a shard for each gather (FULL_SHARD gathers again for backward), offload_optimizer
    once per forward; one gradient download per unit and step."""
    def body(g: ProcessGroup) -> tuple[Any, Any, list[int]]:
        plain = train(g, sharding_strategy=strategy)
        off = train(g, sharding_strategy=strategy, cpu_offload=cpu_offload, forward_prefetch=True,
                    backward_prefetch=True)
        return plain, off, [u.offload.uploads for u in off[0].units]  # type: ignore[union-attr]

    results = run_ranks(2, body)
    for plain, off, uploads in results:
        assert_same(plain, off)
        assert all(isinstance(u.shard, HostShard) for u in off[0].units)
    units = len(results[0][2])
    regather = cpu_offload.offload_params and strategy is S.FULL_SHARD
    initial = 1 if strategy is S.NO_SHARD else 0  # NO_SHARD gathers once at wrap time, for the root's buffers
    final = 1  # full_state_dict() uploads the stepped shards once more
    assert results[0][2] == [initial + STEPS * (2 if regather else 1) + final] * units
    assert sum(c.downloads for c in host_copies) == 2 * STEPS * units


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_memory_stats_count_offloaded_bytes_as_host_bytes(host_copies: list[HostCopies]) -> None:
    """Offloaded: parameters + gradients + optimizer state in host memory; the device keeps nothing between steps
    with offload_params, a copy of the shards with offload_optimizer; memory_estimate(device="cuda") agrees."""
    def body(g: ProcessGroup) -> tuple[dict[str, int], dict[str, int]]:
        params, optim = train(g, cpu_offload=PARAMS), train(g, cpu_offload=OPTIMIZER)
        return params[0].memory_stats(params[1]), optim[0].memory_stats(optim[1])

    linears = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    for by_params, by_optim in run_ranks(2, body):
        for stats, cfg in ((by_params, PARAMS), (by_optim, OPTIMIZER)):
            persistent = stats["parameters"] + stats["gradients"] + stats["optimizer_state"]
            assert stats["offloaded"] == persistent > 0
            assert stats["device_current"] == stats["current"] - persistent
            est = memory_estimate(mlp(0), "fsdp", 2, wrap=linears, cpu_offload=cfg, device="cuda")
            for key in ("parameters", "gradients", "optimizer_state", "offloaded", "device_current", "current"):
                assert abs(est[key] - stats[key]) <= 0.10 * stats[key] + 64, (key, est[key], stats[key])
            # The estimate allows one upload and one download of the largest unit's shard (16 x 16 + 16 float64
            # parameters over 2 ranks: 136 elements) in flight beside a unit's buffers. HostCopies finish every copy
            # at once, so the measured peak may lack them, but never exceeds the estimate.
            in_flight = 2 * 136 * 8
            assert stats["device_peak"] <= est["device_peak"] <= stats["device_peak"] + in_flight, (est, stats)
        assert by_params["device_current"] == 0
        assert by_optim["device_current"] == by_optim["device_shards"] == by_optim["parameters"]


def test_estimate_offloads_only_gpu_models() -> None:
    base = memory_estimate(mlp(0), "fsdp", 2)
    assert memory_estimate(mlp(0), "fsdp", 2, cpu_offload=PARAMS) == base  # a NumPy model: nothing moves
    gpu = memory_estimate(mlp(0), "fsdp", 2, cpu_offload=PARAMS, device="cuda")
    assert gpu["offloaded"] == base["parameters"] + base["gradients"] + base["optimizer_state"]
    assert gpu["device_peak"] < base["device_peak"]
    with pytest.raises(ValueError, match="cpu_offload applies to FSDP"):
        memory_estimate(mlp(0), "ddp", 2, cpu_offload=PARAMS, device="cuda")


def test_cpu_offload_fields_are_checked() -> None:
    with pytest.raises(TypeError, match="offload_optimizer must be a bool"):
        CPUOffload(offload_optimizer="yes")  # type: ignore[arg-type]
    assert not CPUOffload().enabled and PARAMS.enabled and OPTIMIZER.enabled


class _Pending:
    def __init__(self) -> None:
        self.finished = False
        self.host_waits = 0
        self.compute_waits = 0

    def wait_compute(self) -> None:
        self.compute_waits += 1

    def wait_host(self) -> None:
        self.host_waits += 1
        self.finished = True

    def done(self) -> bool:
        return self.finished


class DeferredCopies(HostCopies):
    """HostCopies whose transfers report done only after a wait or `finish_all`: shows who waits, and when."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[_Pending] = []

    def upload(self, host: Any, device: Any) -> Any:
        super().upload(host, device)
        self.transfers.append(_Pending())
        return self.transfers[-1]

    def download(self, device: Any, host: Any) -> Any:
        super().download(device, host)
        self.transfers.append(_Pending())
        return self.transfers[-1]


def test_uploads_once_per_staleness_and_the_compute_waits_not_the_host() -> None:
    copies, stats = DeferredCopies(), MemoryStats()
    off = ShardOffload(copies, np.arange(4.0), keep_on_device=True, stats=stats)
    off.start_upload()
    off.start_upload()  # fresh (on its way): nothing new
    dev = off.on_device()
    assert copies.uploads == 1 and copies.transfers[0].compute_waits == 1 and copies.transfers[0].host_waits == 0
    np.testing.assert_array_equal(dev, np.arange(4.0))
    off.release()  # offload_optimizer keeps the device copy
    assert off.device is dev and stats.device_shard_bytes == 32
    off.mark_stale()
    off.host[:] = 7.0
    assert off.on_device() is dev and copies.uploads == 2  # the same device buffer, uploaded again
    np.testing.assert_array_equal(dev, np.full(4, 7.0))
    off.before_host_write()  # the optimizer is about to write the host shard: wait for the DMA reading it
    assert copies.transfers[1].host_waits == 1
    dropping = ShardOffload(HostCopies(), np.zeros(4), keep_on_device=False, stats=stats)
    dropping.on_device()
    dropping.release()
    assert dropping.device is None and stats.device_shard_bytes == 32 and stats.offloaded_bytes == 64


def test_gradient_downloads_are_waited_for_when_grad_is_read() -> None:
    copies, stats = DeferredCopies(), MemoryStats()
    shard = HostShard(ShardOffload(copies, np.zeros(3), keep_on_device=False, stats=stats))
    shard.receive_grad(np.array([1.0, 2.0, 3.0]))
    pending = copies.transfers[-1]
    assert pending.host_waits == 0 and stats.device_shard_bytes == 24  # the device gradient lives until the copy ends
    np.testing.assert_array_equal(shard.grad, [1.0, 2.0, 3.0])  # reading .grad waited
    assert pending.host_waits == 1 and stats.device_shard_bytes == 0
    shard.receive_grad(np.array([1.0, 1.0, 1.0]))  # no zero_grad: accumulates through the staging buffer
    copies.transfers[-1].finished = True
    shard._offload.poll()
    assert stats.device_shard_bytes == 0  # finished: the device gradient is let go before anyone reads .grad
    np.testing.assert_array_equal(shard.grad, [2.0, 3.0, 4.0])
    assert shard.grad_bytes() == 48 == stats.offloaded_bytes - 24
    shard.receive_grad(np.array([5.0, 5.0, 5.0]))
    shard.grad = None  # zero_grad drops a pending download (after waiting: its buffers are reused)
    assert copies.transfers[-1].host_waits == 1 and shard.grad is None
    shard.data = np.full(3, 9.0)  # assigning copies into the host buffer allocated once
    assert shard.data is shard._offload.host and float(shard.data.sum()) == 27.0
