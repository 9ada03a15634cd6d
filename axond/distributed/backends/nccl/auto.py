"""Backend "auto" where CuPy is installed: NCCL when every member has a GPU of its own, the staging path otherwise.

The members exchange `DeviceClaim`s through the group's store (`placement`), so all decide alike; group rank 0
says which path the group took, once, at init. A member without a GPU runs the plain tcp backend, whose wire
format the staging path shares, so CPU and GPU ranks mix in one group.
"""

from __future__ import annotations

import logging
from typing import Any

from axond.distributed.backends.base import Backend, BackendOptions
from axond.distributed.backends.nccl.backend import NcclBackend
from axond.distributed.backends.nccl.placement import DataPath, choose_path, exchange_claims, local_claim
from axond.distributed.backends.nccl.staging import StagingBackend
from axond.distributed.backends.registry import backend_class
from axond.store import Store

log = logging.getLogger("axond")


def announce(group: str, path: DataPath) -> str:
    """The line group rank 0 logs at init: which path CuPy arrays take, and why."""
    if path.backend == "nccl":
        return f"axond: group {group!r} runs device arrays on NCCL ({path.reason})"
    return (f"axond: group {group!r} stages device arrays through host memory and the tcp backend, because "
            f"{path.reason}; one GPU per rank lets it use NCCL")


class GpuAuto(Backend):
    """Not a backend of its own: building one builds the `NcclBackend`, `StagingBackend` or `TcpBackend` chosen."""

    name = "auto"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Where the staging backend is (CuPy installed): NumPy-only groups use the tcp backend itself."""
        return StagingBackend.is_available()

    def __new__(cls, store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> Any:
        return build(store, rank, size, group_name, options)


def build(store: Store, rank: int, size: int, group_name: str, options: BackendOptions) -> Backend:
    """Exchange the members' claims, decide the path, say it once (group rank 0), build this member's backend."""
    claim = local_claim(options.device, options.runtime_env().local_rank)
    path = choose_path(exchange_claims(store, rank, size, claim, options.timeout, group_name=group_name))
    if rank == 0:
        log.warning(announce(group_name, path))
    if not claim.gpu:
        return backend_class("tcp")(store, rank, size, group_name, options)
    if path.backend == "nccl":
        return NcclBackend(store, rank, size, group_name, options)
    return StagingBackend(store, rank, size, group_name, options, reason=path.reason, device=claim.device)


BACKEND = GpuAuto
