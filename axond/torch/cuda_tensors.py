"""CuPy views of CUDA torch tensors (DLPack), so axond's NCCL backend moves torch data without copies.

A contiguous CUDA tensor is passed as `cupy.from_dlpack(t)`, sharing its memory. Non-contiguous (and
conjugated) tensors go through a contiguous staging tensor written back after the op. bfloat16 is
handed over as its int16 bits (CuPy 13 cannot import a bfloat16 DLPack tensor); where CuPy knows
ml_dtypes' bfloat16 (CuPy >= 14) the bits are viewed as bfloat16, so NCCL reduces them natively
(ncclBfloat16), otherwise reductions run on a float32 copy rounded back once. CuPy is imported on
first use, never when axond.torch is imported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


def cupy_module() -> Any:
    """CuPy, imported on the first CUDA op."""
    import cupy

    return cupy


@functools.lru_cache(maxsize=1)
def cupy_bfloat16() -> Any | None:
    """ml_dtypes' bfloat16 if this CuPy takes it as an array dtype (NCCL then reduces bfloat16 natively), else None."""
    try:
        import ml_dtypes

        cupy_module().zeros(1, dtype="int16").view(ml_dtypes.bfloat16)
    except Exception:  # noqa: BLE001 -- any failure means: no native bfloat16 arrays in this CuPy
        return None
    return ml_dtypes.bfloat16


def check_cuda(t: torch.Tensor, what: str) -> None:
    """Refuse what NCCL cannot move: sparse or other non-strided layouts."""
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{what} has layout {t.layout}; the axond backend moves dense (strided) tensors")


@dataclass
class CudaStaged:
    """A contiguous CUDA tensor NCCL works on: `target` itself, or a stand-in copied back after the op."""

    buf: torch.Tensor
    target: torch.Tensor
    copied: bool

    def write_back(self) -> None:
        """Copy the stand-in into the caller's tensor (on the current stream); no-op for the tensor itself."""
        if self.copied:
            with torch.no_grad():
                self.target.copy_(self.buf)


def stage(t: torch.Tensor, what: str, reduce: bool = False) -> CudaStaged:
    """`t` as a contiguous tensor NCCL can use in place; `reduce` widens bfloat16 to float32 where CuPy lacks it."""
    check_cuda(t, what)
    data = t.detach()
    if reduce and data.dtype == torch.bfloat16 and cupy_bfloat16() is None:
        return CudaStaged(data.float(), t, True)
    if data.is_conj():
        return CudaStaged(data.resolve_conj().contiguous(), t, True)
    if data.is_contiguous():
        return CudaStaged(data, t, False)
    return CudaStaged(data.contiguous(), t, True)


def as_cupy(t: torch.Tensor) -> Any:
    """The CuPy array sharing memory with contiguous CUDA tensor `t` (call it on the stream that will use it)."""
    cp = cupy_module()
    if t.dtype == torch.bfloat16:
        bits = cp.from_dlpack(t.view(torch.int16))
        native = cupy_bfloat16()
        return bits.view(native) if native is not None else bits
    return cp.from_dlpack(t)


def as_torch(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """The torch tensor sharing memory with CuPy array `a` (bfloat16 from its int16 bits)."""
    if dtype == torch.bfloat16:
        return torch.from_dlpack(a.view("int16")).view(torch.bfloat16)
    return torch.from_dlpack(a)


def premultiply(t: torch.Tensor, factor: float | None) -> torch.Tensor:
    """`t` times `factor` in place (PREMUL_SUM), on the current stream; `t` itself when there is no factor."""
    if factor is None:
        return t
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"PREMUL_SUM needs a floating-point tensor, got {t.dtype}")
    return t.mul_(factor)
