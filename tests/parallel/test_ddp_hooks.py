"""DDP communication hooks: torch's (state, bucket) -> future shape, bf16/fp16 compression, on thread ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.parallel import DDP
from axond.parallel.ddp import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from axond.testing import run_threads

WORLD = 2


def model() -> nn.Sequential:
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(8, 64, dtype=np.float32, rng=rng), nn.Tanh(), nn.Linear(64, 4, dtype=np.float32, rng=rng))


def grads(g: ProcessGroup, hook: Any, scale: float = 1.0) -> list[np.ndarray]:
    ddp = DDP(model(), g, bucket_cap_mb=0.001)  # several buckets
    seen: list[tuple[int, bool, int]] = []
    if hook is not None:
        def spy(state: Any, bucket: GradBucket) -> Any:
            seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
            assert state is g
            return hook(state, bucket)
        ddp.register_comm_hook(g, spy)
    x = np.random.default_rng(g.rank).standard_normal((3, 8)).astype(np.float32)
    ddp.backward(np.ones((3, 4), np.float32) * scale + 0 * ddp(x))
    if hook is not None:
        assert [i for i, _, _ in seen] == list(range(len(ddp.buckets))) and seen[-1][1] and not seen[0][1]
    return [p.grad.copy() for p in ddp.parameters()]


def run(hook: Any, scale: float = 1.0) -> list[list[np.ndarray]]:
    return run_threads(lambda g: grads(g, hook, scale), WORLD, 60.0, options=BackendOptions(timeout=20))


def test_the_default_hook_is_the_plain_average() -> None:
    for a, b in zip(run(allreduce_hook)[0], run(None)[0]):
        np.testing.assert_array_equal(a, b)


def local_grads(rank: int) -> list[np.ndarray]:
    m = model()
    x = np.random.default_rng(rank).standard_normal((3, 8)).astype(np.float32)
    m.backward(np.ones((3, 4), np.float32) + 0 * m(x))
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize(("hook", "rtol", "atol"), [(bf16_compress_hook, 2**-7, 1e-7), (fp16_compress_hook, 2**-10, 6.2e-5)])
def test_compressed_averages_are_within_one_rounding(hook: Any, rtol: float, atol: float) -> None:
    """Each rank's gradient is rounded once to the compressed dtype (half an ulp: 2**-9 bfloat16, 2**-12 float16),
    summed in float32 and rounded once more: within ~2 ulps of the ranks' mean magnitude (not of the average,
    which may cancel); float16 also flushes values under its smallest normal (6.1e-5) to zero. Ranks agree bitwise."""
    want = run(None)[0]
    local = [local_grads(r) for r in range(WORLD)]
    got = run(hook)
    for r in got[1:]:
        for a, b in zip(r, got[0]):
            assert a.tobytes() == b.tobytes()
    for i, (a, b) in enumerate(zip(got[0], want)):
        assert a.dtype == np.float32
        scale = sum(np.abs(g[i]) for g in local) / WORLD
        assert (np.abs(a - b) <= rtol * scale + atol).all()
    assert any(not np.array_equal(a, b) for a, b in zip(got[0], want))  # it did compress


def test_fp16_flushes_what_would_be_subnormal() -> None:
    """Gradients scaled below float16's smallest normal (6.1e-5) come back as zeros, not slow subnormals."""
    got = run(fp16_compress_hook, scale=1e-9)[0]
    assert all(not g.any() for g in got)
    tiny = run(bf16_compress_hook, scale=1e-9)[0]  # bfloat16 has float32's range: kept
    assert any(g.any() for g in tiny)


def test_register_once_with_a_callable() -> None:
    ddp = DDP(model(), ProcessGroup.mock())
    with pytest.raises(TypeError, match="callable"):
        ddp.register_comm_hook(None, "bf16")
    ddp.register_comm_hook(None, bf16_compress_hook)
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.register_comm_hook(None, bf16_compress_hook)
