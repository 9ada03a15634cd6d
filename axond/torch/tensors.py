"""NumPy views of CPU torch tensors, so axond's collectives move torch data without copies.

A contiguous CPU tensor shares memory with `t.numpy()`. Non-contiguous tensors are copied into a
contiguous staging tensor and copied back after the op. NumPy has no bfloat16: data movement uses
the bits viewed as uint16, and reductions run on a float32 copy that is rounded back to bfloat16
once at the end (accumulating in float32, the numerically right order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from axond.torch.devices import cuda_refusal, why_no_cuda


def check_cpu(t: torch.Tensor, what: str) -> None:
    """Refuse tensors axond's tcp data plane cannot touch, saying what to do."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(_not_cpu(what, t.device))
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{what} has layout {t.layout}; the axond backend moves dense (strided) tensors")


def _not_cpu(what: str, device: torch.device) -> str:
    """Why a tensor on `device` cannot go this (CPU) path, and what to do (probes CUDA only on this error path)."""
    if device.type != "cuda":
        return f"{what} is on {device}; the axond backend moves CPU tensors (and CUDA tensors where NCCL runs): use .cpu()"
    why = why_no_cuda()
    if why:
        return cuda_refusal(what, device, why)
    return (f"{what} is on {device}; axond's own collectives take CPU tensors or CuPy arrays (on a group of backend "
            "'nccl'), and torch.distributed on \"axond\" takes CUDA tensors: use .cpu() or one of those")


@dataclass
class Staged:
    """A NumPy view of tensor `target` (or of a contiguous stand-in) and how to write the stand-in back."""

    array: np.ndarray
    target: torch.Tensor
    stand_in: torch.Tensor | None

    def write_back(self) -> None:
        """Copy the stand-in's result into the caller's tensor (no-op for a direct view)."""
        if self.stand_in is not None:
            self.target.copy_(self.stand_in)


def stage(t: torch.Tensor, what: str, reduce: bool = False) -> Staged:
    """A NumPy array sharing memory with `t` when possible; `reduce` widens bfloat16 to float32 for arithmetic."""
    check_cpu(t, what)
    data = t.detach()
    if data.dtype == torch.bfloat16:
        if reduce:
            wide = data.float()
            return Staged(wide.numpy(), t, wide)
        if data.is_contiguous():
            return Staged(data.view(torch.uint16).numpy(), t, None)
        copy = data.contiguous()
        return Staged(copy.view(torch.uint16).numpy(), t, copy)
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_contiguous():
        return Staged(data.numpy(), t, None)
    copy = data.contiguous()
    return Staged(copy.numpy(), t, copy)


def readonly(t: torch.Tensor, what: str, reduce: bool = False) -> np.ndarray:
    """A NumPy array with `t`'s values for reading (a view when contiguous); bfloat16 as uint16 bits or float32."""
    return stage(t, what, reduce).array


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor sharing memory with `a`, reinterpreted as `dtype` (bfloat16 from uint16 bits or by rounding)."""
    if dtype == torch.bfloat16:
        if a.dtype == np.uint16:
            return torch.from_numpy(a).view(torch.bfloat16)
        return torch.from_numpy(a).to(torch.bfloat16)
    return torch.from_numpy(a)


def copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """Write NumPy `src` (uint16 bits or float32 for bfloat16 `dst`) into `dst`, any strides."""
    with torch.no_grad():
        dst.copy_(from_numpy(np.ascontiguousarray(src), dst.dtype).reshape(dst.shape))
