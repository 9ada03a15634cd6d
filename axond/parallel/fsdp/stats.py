"""FSDP's memory accounting: bytes of the buffers a wrapper allocates and frees during a step, and their peaks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryStats:
    """Bytes of full (unsharded) parameter and gradient buffers alive now, and their peaks since reset.

    With CPU offload also the pinned host buffers (`offloaded_bytes`) and the device copies of shards and of
    gradient shards waiting for their download (`device_shard_bytes`)."""

    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    full_grad_bytes: int = 0
    device_shard_bytes: int = 0
    offloaded_bytes: int = 0
    """Host buffers allocated once per offloaded unit: the master shard, its gradient and a staging buffer."""
    peak_transient_bytes: int = 0
    """Peak of gathered + full-gradient + device-shard bytes together."""

    def add_gathered(self, n: int) -> None:
        self.gathered_bytes += n
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self._peak()

    def add_full_grad(self, n: int) -> None:
        self.full_grad_bytes += n
        self._peak()

    def add_device_shard(self, n: int) -> None:
        self.device_shard_bytes += n
        self._peak()

    def transient_bytes(self) -> int:
        return self.gathered_bytes + self.full_grad_bytes + self.device_shard_bytes

    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is alive now."""
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_transient_bytes = self.transient_bytes()

    def _peak(self) -> None:
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.transient_bytes())
