"""Makes `torch.distributed.init_process_group("axond")` work without `import axond.torch`.

torch calls `register` while it imports (its "torch.backends" entry points; off with
TORCH_DEVICE_BACKEND_AUTOLOAD=0). It stays cheap, since every `import torch` of the environment pays for it: it
imports nothing of axond and only tells torch.distributed the name "axond" and the scheme `axond://`; the first
group or rendezvous that uses them imports `axond.torch`, which registers the real backend in their place. A
separate top-level package, so that torch's import does not import the `axond` package.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

BACKEND = "axond"


def _devices(torch: Any) -> list[str]:
    """What `axond.torch.devices.devices_here` decides: CUDA too when CuPy is installed and torch sees a GPU."""
    if importlib.util.find_spec("cupy") is None:
        return ["cpu"]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _real() -> Any:
    """axond.torch, imported on first use; importing it registers the real backend in this one's place."""
    import axond.torch

    return axond.torch


def _create(*args: Any, **kwargs: Any) -> Any:
    """torch's backend creator: create the group with axond.torch's."""
    return _real().create_process_group(*args, **kwargs)


def _rendezvous(*args: Any, **kwargs: Any) -> Any:
    """The `axond://` rendezvous handler, from axond.torch."""
    real = _real()
    real.install()
    return real.rendezvous._axond_handler(*args, **kwargs)


def register() -> None:
    """Register "axond" and `axond://` with torch.distributed, lazily (see the module docstring)."""
    torch = sys.modules.get("torch")
    dist = sys.modules.get("torch.distributed")
    if torch is None or dist is None or not dist.is_available():
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=False, devices=_devices(torch))
    handlers = getattr(sys.modules.get("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if handlers is not None and BACKEND not in handlers:
        dist.register_rendezvous_handler(BACKEND, _rendezvous)
