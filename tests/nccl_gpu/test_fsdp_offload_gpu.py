"""FSDP's CPU offload on a GPU (CuPy models, NCCL): runs where a GPU is present, skipped elsewhere.

Parity of training with offload_params / offload_optimizer against FSDP without offload, the shards in pinned
host memory, the device memory the offload gives back (CuPy's memory pool), and a copy on the copy stream
running beside compute on the compute stream (CUDA event timings). World size 1 runs in this process over an
NCCL group of one; `test_two_gpus_match` runs one process per GPU as tests/nccl_gpu/test_nccl_gpu.py does.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup, create_group
from axond.nn.optim import AdamW
from axond.parallel.fsdp import FSDP, CPUOffload
from axond.parallel.fsdp.offload import HostShard
from axond.store import InMemoryStore
from axond.testing import run_processes
from gpu_cases import need_nccl  # noqa: F401 - the fixture
from parity_models import mlp, mlp_data

pytestmark = pytest.mark.gpu

OFFLOADS = {
    "params": CPUOffload(offload_params=True),
    "optimizer": CPUOffload(offload_optimizer=True),
    "both": CPUOffload(offload_params=True, offload_optimizer=True),
}
# The host step (NumPy) and the device step (CuPy) may round AdamW's sqrt and fused multiply-adds differently:
# a few float64 ulps per step, ~1e-15 relative after 4 steps. 1e-10 is far below any wrong value (a stale
# upload or a lost gradient moves parameters by > 1e-3).
TOL = 1e-10


@pytest.fixture(autouse=True)
def need_gpu(need_nccl: None) -> None:
    """Every test here needs NCCL (skipped with the reason elsewhere)."""


def cupy_module() -> Any:
    import cupy

    return cupy


@pytest.fixture
def group() -> Any:
    pg = create_group(InMemoryStore(), 0, 1, "nccl", BackendOptions(timeout=30.0, device=0))
    try:
        yield pg
    finally:
        pg.destroy()


def train(g: ProcessGroup, model: nn.Module, steps: int = 4, **kwargs: Any) -> tuple[FSDP, AdamW, list[np.ndarray]]:
    """`steps` of AdamW on this rank's rows of the parity batches; the outputs (on the host) of every step."""
    cp = cupy_module()
    fsdp = FSDP(model.to("cuda"), group=g, wrap=lambda m: isinstance(m, nn.Linear), **kwargs)
    opt = AdamW(list(fsdp.parameters()), lr=1e-2)
    loss = nn.CrossEntropyLoss()
    outputs = []
    for step in range(steps):
        x, y = mlp_data(step, 4 * g.size)
        rows = slice(4 * g.rank, 4 * g.rank + 4)
        opt.zero_grad()
        out = fsdp(cp.asarray(x[rows]))
        outputs.append(cp.asnumpy(out))
        loss(out, cp.asarray(y[rows]))
        fsdp.backward(loss.backward())
        opt.step()
    return fsdp, opt, outputs


def host_state(fsdp: FSDP) -> dict[str, np.ndarray]:
    cp = cupy_module()
    return {k: cp.asnumpy(v) for k, v in fsdp.full_state_dict().items()}


def check_parity(g: ProcessGroup) -> None:
    plain = train(g, mlp(0))
    want = host_state(plain[0])
    for name, cfg in OFFLOADS.items():
        got = train(g, mlp(0), cpu_offload=cfg, forward_prefetch=True, backward_prefetch=True)
        assert all(isinstance(u.shard, HostShard) and type(u.shard.data) is np.ndarray for u in got[0].units), name
        assert all(type(v) is np.ndarray for st in got[1].state for v in st.values() if hasattr(v, "shape")), name
        for a, b in zip(got[2], plain[2]):
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=name)
        for k, v in host_state(got[0]).items():
            np.testing.assert_allclose(v, want[k], rtol=TOL, atol=TOL, err_msg=f"{name} {k}")


def test_offload_trains_like_no_offload(group: ProcessGroup) -> None:
    check_parity(group)


@pytest.mark.timeout(600)
def test_two_gpus_match() -> None:
    cp = cupy_module()
    if int(cp.cuda.runtime.getDeviceCount()) < 2:
        pytest.skip(f"needs 2 GPUs (NCCL refuses two ranks on one device); {cp.cuda.runtime.getDeviceCount()} visible")
    here = Path(__file__).resolve().parent
    env = {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent / "helpers"), os.environ.get("PYTHONPATH", "")])}
    run_processes("test_fsdp_offload_gpu", 2, timeout=300, args=["parity"], env=env)


def test_shards_live_in_pinned_host_memory(group: ProcessGroup) -> None:
    cp = cupy_module()
    runtime = cp.cuda.runtime
    fsdp, opt, _ = train(group, mlp(0), steps=1, cpu_offload=OFFLOADS["params"])
    host_type = getattr(runtime, "memoryTypeHost", 1)  # cudaMemoryTypeHost: page-locked host memory
    for u in fsdp.units:
        assert runtime.pointerGetAttributes(u.shard.data.ctypes.data).type == host_type
        assert runtime.pointerGetAttributes(u.shard.grad.ctypes.data).type == host_type
        assert u.offload is not None and u.offload.device is None  # offload_params: dropped after the gathers


def wide() -> nn.Sequential:
    rng = np.random.default_rng(0)
    return nn.Sequential(*[nn.Linear(512, 512, dtype=np.float32, rng=rng) for _ in range(4)])


def device_bytes_after_training(g: ProcessGroup, cfg: CPUOffload | None) -> tuple[int, dict[str, int]]:
    """Bytes CuPy's device pool holds after two steps (what the wrapper and optimizer keep), and memory_stats."""
    cp = cupy_module()
    pool = cp.get_default_memory_pool()
    gc.collect()
    base = pool.used_bytes()
    fsdp = FSDP(wide().to("cuda"), group=g, wrap=lambda m: isinstance(m, nn.Linear), cpu_offload=cfg)
    opt = AdamW(list(fsdp.parameters()), lr=1e-3)
    x = cp.ones((2, 512), dtype=cp.float32)
    for _ in range(2):
        opt.zero_grad()
        out = fsdp(x)
        fsdp.backward(cp.ones_like(out))
        opt.step()
    del out
    cp.cuda.Device(0).synchronize()
    gc.collect()
    used = pool.used_bytes() - base
    stats = fsdp.memory_stats(opt)
    del fsdp, opt
    gc.collect()
    return used, stats


@pytest.mark.parametrize("name", ["params", "optimizer"])
def test_offload_gives_device_memory_back(group: ProcessGroup, name: str) -> None:
    plain, plain_stats = device_bytes_after_training(group, None)
    used, stats = device_bytes_after_training(group, OFFLOADS[name])
    persistent = stats["parameters"] + stats["gradients"] + stats["optimizer_state"]
    assert stats["offloaded"] == persistent
    # The pool also holds the input, the loss gradient and small scratch: 10 % of what moved, plus 1 MiB.
    slack = 0.10 * persistent + (1 << 20)
    assert used <= plain - stats["offloaded"] + stats["device_current"] + slack, (used, plain, stats)
    assert plain_stats["offloaded"] == 0


def test_uploads_run_beside_compute() -> None:
    """An upload started before a long matmul is issued on the compute stream overlaps it (event timings)."""
    cp = cupy_module()
    from axond.parallel.fsdp.offload_cuda import CudaCopies

    copies = CudaCopies(0)
    host = copies.host_empty(16 << 20, np.float32)  # 64 MiB: several ms over PCIe
    host[...] = 1.0
    device = copies.device_empty(host.size, np.float32)
    a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
    compute = cp.cuda.get_current_stream()
    begin, end = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.Device(0).synchronize()
    begin.record(compute)
    upload = copies.upload(host, device)
    for _ in range(8):
        a = a @ a / 4096.0
    end.record(compute)
    end.synchronize()
    upload.wait_host()
    compute_ms = cp.cuda.get_elapsed_time(begin, end)
    upload_starts = cp.cuda.get_elapsed_time(begin, upload.start_event)
    upload_ends = cp.cuda.get_elapsed_time(begin, upload.end_event)
    assert upload.elapsed_ms() > 0.5, "the copy is too short to show overlap"
    assert upload_starts < compute_ms and upload_ends < compute_ms, (upload_starts, upload_ends, compute_ms)
    assert float(device[:4].sum()) == 4.0


def _rank_main(argv: list[str]) -> int:
    """Entry of one rank process started by `test_two_gpus_match`."""
    import axond

    pg = axond.init_process_group("nccl", timeout=60.0)
    try:
        if argv[0] == "parity":
            check_parity(pg)
    finally:
        axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
