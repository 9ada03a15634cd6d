"""How an "axond" group presents itself to torch as torch's own backends do: the device types it takes
(`_device_types`, `_get_backend`), its capability flags, its sequence number, and the profiler ranges its ops
open (named as gloo's: `axond:all_reduce` where gloo records `gloo:all_reduce`)."""

from __future__ import annotations

from typing import Any

import torch


class TorchBackendIdentity:
    """Mixed into `AxondProcessGroup` (before torch's `ProcessGroup`, whose C++ versions it overrides for Python
    callers); the group counts its ops in `_seq`."""

    _seq: int

    DEVICE_TYPES: tuple[str, ...] = ("cpu",)
    """The device types this group takes, as torch's own backends register theirs (`_device_types`)."""

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group takes ([cpu], plus cuda for `AxondCudaProcessGroup`), as `pg._device_types` of
        torch's own backends lists them: DCP's `async_save` needs cpu there, and full-state-dict broadcasts pick
        their device from it."""
        return [torch.device(d) for d in self.DEVICE_TYPES]

    def _get_backend(self, device: Any) -> TorchBackendIdentity:
        """The backend of `device`: this group itself for its device types (torch asks it `supports_*` and
        sequence numbers), else torch's error."""
        kind = torch.device(device).type
        if kind not in self.DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def _get_sequence_number_for_group(self) -> int:
        """How many ops torch started on this group (the same on every member that made the same calls)."""
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        """torch calls it on a new group; the count starts at 0 there already."""


profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler records (a C call of ~40 ns): only then does an op open a `record_function` range."""

_EVENTS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
           "allgather_coalesced": "all_gather_coalesced", "allgather_into_tensor_coalesced": "all_gather_into_tensor",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor", "alltoall": "all_to_all",
           "all_to_all_single": "all_to_all_single", "recv_anysource": "recvAnySource"}


def profiler_event(op: str) -> str:
    """The profiler range of op `op` (a method name), named as gloo names its own: `axond:all_reduce`,
    `axond:broadcast`, `axond:send`, ..."""
    return f"axond:{_EVENTS.get(op, op)}"
