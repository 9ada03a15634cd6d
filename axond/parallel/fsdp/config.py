"""FSDP's options: the sharding strategy, CPU offload and the validated options of one wrapper."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ShardingStrategy(Enum):
    """How a unit's parameters, gradients and optimizer state are spread over the ranks."""

    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters gathered for each unit's forward and again for its backward, freed after each."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: parameters gathered for the forward and kept until the unit's backward is done."""
    NO_SHARD = "no_shard"
    """Full parameters on every rank, gradients all-reduced (AVG): DDP through the FSDP interface."""
    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD within each shard group of a 2-d DeviceMesh, gradient shards averaged across replicas."""


@dataclass(frozen=True)
class CPUOffload:
    """What lives in host memory between uses, for models on a GPU (CuPy). A no-op for NumPy models: their compute
    device is the host, so there is nothing to offload to (see docs/fsdp.md, "CPU offload")."""

    offload_params: bool = False
    """torch's field: shards and gradient shards live in pinned host memory. Each shard is uploaded for its unit's
    gathers (the next unit's upload overlapping this unit's compute) and dropped after them. The optimizer, built
    over `fsdp.parameters()`, steps on the host and keeps its state there. Implies `offload_optimizer`."""
    offload_optimizer: bool = False
    """DeepSpeed's ZeRO-Offload: master shards, their gradients and the optimizer state live in pinned host memory
    and the step runs on the host. A device copy of each shard stays on the GPU, uploaded again once per forward."""
    pin_memory: bool = True
    """Page-locked host buffers (`cupyx.empty_pinned`): the copies run asynchronously on a copy stream."""

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded (on a GPU model)."""
        return self.offload_params or self.offload_optimizer

    def __post_init__(self) -> None:
        for name in ("offload_params", "offload_optimizer", "pin_memory"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CPUOffload.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class FSDPConfig:
    """Validated options of one `FullyShardedDataParallel` wrapper."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """How parameters and gradients are sharded."""
    cpu_offload: CPUOffload = CPUOffload()
    """Whether shards, gradient shards and optimizer state live in host memory (GPU models)."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers at wrap time, so every rank starts from the same model."""
    forward_prefetch: bool = False
    """In forward, start gathering the next unit (in the last forward's order) while this one computes."""
    backward_prefetch: bool = False
    """In backward, start re-gathering the next unit (FULL_SHARD, HYBRID_SHARD) and reduce-scatter the unit
    whose backward just ended on the group's communication thread, while this unit computes.

    Both prefetches hold one more unit's buffers. They pay off when the network, not the CPU, is the
    bottleneck (GPU ranks, spare cores); with every core busy computing, as in bench/sharding.py on 2 cores,
    the extra thread only competes with the compute (measured slower), hence off by default."""

    def __post_init__(self) -> None:
        if not isinstance(self.sharding_strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {self.sharding_strategy!r}")
        if not isinstance(self.cpu_offload, CPUOffload):
            raise TypeError(f"cpu_offload must be a CPUOffload or None, got {self.cpu_offload!r}")
