"""DDP's options: when gradients are synchronised, bucket sizes, buffer broadcasting."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class GradSyncStrategy(Enum):
    """When `DistributedDataParallel.backward` averages gradients over the group."""

    SYNCHRONOUS = "synchronous"
    """After the whole local backward: every bucket reduced in order, nothing overlapped."""
    OVERLAPPED = "overlapped"
    """During backward: a bucket's all-reduce starts as soon as its last gradient is produced."""
    NO_SYNC = "no_sync"
    """Never in backward; call `sync_gradients()` yourself (or use `no_sync()` for a few steps)."""


@dataclass(frozen=True)
class DDPConfig:
    """Validated options of one `DistributedDataParallel` wrapper."""

    bucket_cap_mb: float = 25.0
    """Largest gradient bucket in MiB (a single larger parameter gets a bucket of its own)."""
    first_bucket_cap_mb: float | None = None
    """Cap of the first bucket (the last layers' gradients) so that communication starts early; None: `bucket_cap_mb`."""
    strategy: GradSyncStrategy = GradSyncStrategy.OVERLAPPED
    """When gradients are averaged."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers to every rank before each forward (e.g. running statistics)."""
    timeout: float | None = None
    """Seconds to wait for one bucket's all-reduce; None: the process group's timeout."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.first_bucket_cap_mb is not None and not self.first_bucket_cap_mb > 0:
            raise ValueError(f"first_bucket_cap_mb must be > 0 or None, got {self.first_bucket_cap_mb}")
        if not isinstance(self.strategy, GradSyncStrategy):
            raise TypeError(f"strategy must be a GradSyncStrategy, got {self.strategy!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {self.timeout}")
