"""What the GPU-marked tests share: why they cannot run here, checked lazily (at test time, not import)."""

from __future__ import annotations

import functools

import pytest

from axond.distributed.backends.nccl import NcclBackend
from axond.distributed.numerics.reduce_op import ReduceOp
from collective_cases import ARITHMETIC, DTYPES, refused


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


def nccl_refusal(dtype: str, op: ReduceOp) -> str | None:
    """The TypeError message (a regex) with which the NCCL backend refuses reducing `dtype` with `op`, or None where
    it runs: the CPU rule first (`check_reduce_op`, shared by every backend), then NCCL's lack of 16-bit integers."""
    if refused(dtype, op):
        return "AVG is undefined on bool|AVG is refused|is bitwise"
    if dtype in ("int16", "uint16"):
        return "16-bit integer"
    return None


REDUCTIONS: dict[str, list[tuple[str, ReduceOp]]] = {
    "all_reduce": [(d, op) for d in DTYPES for op in ARITHMETIC],  # NCCL has no bitwise reductions
    "broadcast_reduce": [("float64", op) for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)],
    "gather_scatter": [("int32", op) for op in ARITHMETIC],
}
"""Every (dtype, op) the GPU suite (tests/nccl_gpu/test_nccl_gpu.py) reduces, by case:
tests/nccl_gpu/test_nccl_plans.py checks on the CPU that the NCCL plan refuses exactly the pairs `nccl_refusal` names,
so the GPU cases cannot go stale."""
