"""Which devices the "axond" torch backend takes, and which path a call's tensors go: CUDA-free decisions.

CPU tensors always run on axond's tcp data plane. CUDA tensors run on axond's NCCL backend (CuPy) where
torch sees a GPU and CuPy is installed; then "axond" is registered for ["cpu", "cuda"], otherwise for
["cpu"] and a CUDA tensor is refused saying what to install. Nothing here imports CuPy at import time.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch

Path = Literal["cpu", "cuda"]

INSTALL_HINT = "pip install 'axond[gpu]' (CuPy and NCCL) on a machine with a GPU, or move the tensor with .cpu()"


def registered_devices(torch_has_cuda: bool, cupy_installed: bool) -> list[str]:
    """The device types to register "axond" for: CUDA too when torch sees a GPU and CuPy is installed."""
    return ["cpu", "cuda"] if torch_has_cuda and cupy_installed else ["cpu"]


def devices_here() -> list[str]:
    """`registered_devices` of this process, decided without importing CuPy or initialising CUDA (so importing
    axond.torch before forking stays safe); the full NCCL probe runs when the first CUDA op builds its group."""
    return registered_devices(torch.cuda.is_available(), importlib.util.find_spec("cupy") is not None)


def why_no_cuda() -> str:
    """Why CUDA tensors cannot use "axond" here (empty when they can); imports CuPy only if torch sees a GPU."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    from axond.distributed.backends.nccl import NcclBackend

    ok, why = NcclBackend.is_available()
    return "" if ok else f"axond's NCCL backend cannot run: {why}"


def cuda_refusal(what: str, device: object, why: str) -> str:
    """The error for a CUDA tensor "axond" cannot take here: what, why, and what to do."""
    return f"{what} is on {device}, but the axond torch backend runs CPU tensors only here ({why}); {INSTALL_HINT}"


def tensor_devices(args: Sequence[Any]) -> set[str]:
    """The device types of the tensors in a ProcessGroup method's arguments (tensors, lists, lists of lists)."""
    found: set[str] = set()
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.add(arg.device.type)
        elif isinstance(arg, (list, tuple)):
            _add(found, arg)
    return found


def _add(found: set[str], items: Iterable[Any]) -> None:
    for item in items:
        if isinstance(item, torch.Tensor):
            found.add(item.device.type)
        elif isinstance(item, (list, tuple)):
            found.update(t.device.type for t in item if isinstance(t, torch.Tensor))


def route(op: str, group: str, devices: set[str], cuda_registered: bool) -> Path:
    """The path of one call whose tensors are on `devices` in a group that takes CUDA tensors or not.

    One device type per call: a mix of CPU and CUDA tensors is refused (torch's NCCL and gloo refuse it too).
    Device types other than CPU and CUDA go the CPU path, which refuses them by name.
    """
    if len(devices) > 1:
        raise TypeError(f"{op} on group '{group}': the tensors are on {sorted(devices)}; one call takes tensors of "
                        "one device type (move them with .cpu() or .cuda() first)")
    if "cuda" not in devices:
        return "cpu"
    if not cuda_registered:
        raise TypeError(cuda_refusal(f"{op} on group '{group}': a tensor", "cuda", why_no_cuda() or
                                     "CuPy was not installed when axond.torch was imported"))
    return "cuda"
