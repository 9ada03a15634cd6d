"""PyTorch on axond: `import axond.torch` registers the torch.distributed backend "axond" (CPU tensors).

Inside a rank started by `axond worker`/`axond run`, `torch.distributed.init_process_group("axond")`
needs nothing else; from any launcher, `init_method="axond://HOST:PORT"` rendezvouses over the
coordinator. torch's DDP, FSDP2, DTensor and the object collectives then run on axond's data plane.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from axond.distributed.api import _secret
from axond.distributed.backends.base import BackendOptions
from axond.torch.process_group import BACKEND, AxondProcessGroup, axond_op, timeout_seconds
from axond.torch.rendezvous import coordinator_store, install
from axond.torch.store import AxondStoreOverTorch, TorchStore

__all__ = ["BACKEND", "AxondProcessGroup", "AxondStoreOverTorch", "TorchStore", "axond_op", "coordinator_store",
           "create_process_group"]


def create_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> AxondProcessGroup:
    """torch's backend creator: one member of an axond group rendezvousing over torch's (prefixed) store."""
    options = BackendOptions(timeout=timeout_seconds(timeout), job_secret=_secret())
    return AxondProcessGroup(AxondStoreOverTorch(store), rank, size, options)


def _register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create_process_group, extended_api=False, devices=["cpu"])
    install()


_register()
