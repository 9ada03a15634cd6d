"""What the GPU-marked tests share: why they cannot run here, checked lazily (at test time, not import)."""

from __future__ import annotations

import functools

import pytest

from axond.distributed.backends.nccl import NcclBackend


@functools.lru_cache(maxsize=1)
def nccl_reason() -> str:
    """Empty if CuPy and NCCL can run here, else why not."""
    ok, why = NcclBackend.is_available()
    return "" if ok else f"needs a CUDA GPU with CuPy and NCCL: {why}"


@pytest.fixture
def need_nccl() -> None:
    """Skip the test, with the reason, where NCCL cannot run."""
    reason = nccl_reason()
    if reason:
        pytest.skip(reason)
