"""`DistributedDataParallel`: the same model on every rank, gradients averaged during backward.

Construction broadcasts rank 0's parameters and buffers so every replica starts equal. `backward`
runs the wrapped module's backward while the `GradientSynchronizer` all-reduces finished buckets
in the background, and returns only once every bucket's average is back in `.grad`; after it the
optimizer step is identical on every rank, so the replicas stay equal without further traffic.

A backward that reaches the parameters without `DDP.backward` (the inner model's own `backward`) leaves
local gradients that would make the replicas drift apart silently: the next optimizer step or DDP
forward raises instead (`BypassedBackwardError`), unless `sync_gradients()` averaged them first.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from axond.nn.device import Array
from axond.nn.module import Module, RemovableHandle
from axond.parallel.ddp.buckets import GradientSynchronizer, GroupLike
from axond.parallel.ddp.comm import broadcast_coalesced, default_group
from axond.parallel.ddp.config import DDPConfig, GradSyncStrategy
from axond.parallel.bypass import BackwardGuard
from axond.parallel.no_sync import NoSync


class DistributedDataParallel(NoSync, Module):
    """Wrap `module` for data-parallel training over `process_group` (default: axond's default group)."""

    def __init__(
        self,
        module: Module,
        process_group: Any = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        strategy: GradSyncStrategy = GradSyncStrategy.OVERLAPPED,
        broadcast_buffers: bool = True,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an axond.nn.Module, got {type(module).__name__}")
        self.config = DDPConfig(bucket_cap_mb, first_bucket_cap_mb, strategy, broadcast_buffers, timeout)
        self.module = module
        self.process_group: GroupLike = process_group if process_group is not None else default_group()
        self._sync_enabled = True
        self.sync_parameters()
        self._guard = BackwardGuard(
            "ddp", "DistributedDataParallel",
            f"its gradients were not averaged over group '{getattr(self.process_group, 'name', '?')}' and the "
            "replicas would drift apart",
        )
        owners = Counter(id(p) for m in module.modules() for p in m._parameters.values())
        shared = {pid for pid, count in owners.items() if count > 1}
        self.synchronizer = GradientSynchronizer(
            list(module.parameters()),
            self.process_group,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            timeout=timeout,
            shared=shared,
        )
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._hooks: list[RemovableHandle] = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]
        self._hooks += self._guard.guard_steps(trainable)

    @property
    def strategy(self) -> GradSyncStrategy:
        return self.config.strategy

    @property
    def buckets(self) -> list[Any]:
        """The `GradientBucket`s, in launch order (reverse parameter order)."""
        return self.synchronizer.buckets

    @property
    def events(self) -> list[tuple[float, str, int]]:
        """Timeline of the last backward: (perf_counter, event, bucket index or -1)."""
        return self.synchronizer.events

    def sync_parameters(self) -> None:
        """Copy group rank 0's parameters and buffers to every rank (in place)."""
        if self.process_group.size == 1:
            return
        arrays = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        broadcast_coalesced(arrays, self.process_group, src=0)

    def _sync_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if buffers and self.process_group.size > 1:
            broadcast_coalesced(buffers, self.process_group, src=0)

    def _on_grad_ready(self, param: Any) -> None:
        if self._guard.inside:
            self.synchronizer.on_grad_ready(param)
        else:
            self._guard.noticed_backward()

    def forward(self, x: Array) -> Array:
        self._guard.check()
        if self.config.broadcast_buffers:
            self._sync_buffers()
        return self.module(x)

    def backward(self, grad_out: Array) -> Array:
        """The module's backward with gradients averaged over the group before it returns."""
        syncing = (
            self._sync_enabled and self.config.strategy is not GradSyncStrategy.NO_SYNC and self.process_group.size > 1
        )
        sync = self.synchronizer
        if not syncing:
            sync.disarm()
            with self._guard.running():
                grad_in = self.module.backward(grad_out)
            if self._sync_enabled and self.config.strategy is not GradSyncStrategy.NO_SYNC:
                self._guard.clear()  # one member: nothing to average, the gradients are final
            return grad_in
        sync.prepare()
        if self.config.strategy is GradSyncStrategy.SYNCHRONOUS:
            sync.disarm()
        sync.record("backward_begin")
        try:
            with self._guard.running():
                grad_in = self.module.backward(grad_out)
        except BaseException:
            sync.disarm()
            raise
        sync.record("module_backward_end")
        sync.finish()
        sync.record("backward_end")
        self._guard.clear()  # every gradient, including a bypassing backward's, is averaged now
        return grad_in

    def sync_gradients(self) -> None:
        """Average every parameter's `.grad` over the group now (for NO_SYNC or manual accumulation)."""
        if self.process_group.size > 1:
            self.synchronizer.sync_now()
        self._guard.clear()

    def remove_hooks(self) -> None:
        """Detach DDP from the module's parameters (the module can then be used on its own again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def extra_repr(self) -> str:
        return f"buckets={len(self.buckets)}, strategy={self.config.strategy.name}"


DDP = DistributedDataParallel
