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

import numpy as np

from axond.nn.device import Array
from axond.nn.module import Module, RemovableHandle
from axond.parallel.ddp.buckets import GradientSynchronizer, GroupLike
from axond.parallel.ddp.comm import broadcast_coalesced, default_group
from axond.parallel.ddp.config import DDPConfig, GradSyncStrategy
from axond.parallel.ddp.working import WorkingParams
from axond.parallel.optimizer_state import optimizer_state_bytes
from axond.parallel.mixed_precision import MixedPrecision, cast_buffers, check_mixed_precision
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
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps an axond.nn.Module, got {type(module).__name__}")
        self.config = DDPConfig(bucket_cap_mb, first_bucket_cap_mb, strategy, broadcast_buffers, timeout)
        self.module = module
        self.mixed_precision = check_mixed_precision(mixed_precision)
        cast_buffers(module, self.mixed_precision)
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
            mixed_precision=self.mixed_precision,
        )
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.working = WorkingParams(trainable, self.mixed_precision)
        """The param_dtype copies forward/backward compute with (MixedPrecision); the masters stay float32."""
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
        if self.mixed_precision is None:
            return self.module(x)
        self.working.cast()
        try:
            return self.module(self.mixed_precision.cast_input(x))
        finally:
            if not self.module.training:
                self.working.restore()  # no backward follows an eval forward

    def backward(self, grad_out: Array) -> Array:
        """The module's backward with gradients averaged over the group before it returns."""
        syncing = (
            self._sync_enabled and self.config.strategy is not GradSyncStrategy.NO_SYNC and self.process_group.size > 1
        )
        if self.mixed_precision is not None:
            grad_out = self.mixed_precision.cast_input(grad_out)
        try:
            return self._backward(grad_out, syncing)
        finally:
            self.working.restore()

    def _backward(self, grad_out: Array, syncing: bool) -> Array:
        sync = self.synchronizer
        if not syncing:
            sync.disarm()
            with self._guard.running():
                grad_in = self.module.backward(grad_out)
            if self._sync_enabled and self.config.strategy is not GradSyncStrategy.NO_SYNC:
                self._guard.clear()  # one member: nothing to average, the gradients are final
                self.working.cast_grads({id(p): b.grad_dtype for b in sync.buckets for p in b.params})
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

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce every gradient bucket with `hook(state, bucket) -> HookFuture` (torch's shape; see
        `axond.parallel.ddp.hooks`: `bf16_compress_hook`, `fp16_compress_hook`). Once, before the first backward."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook needs a callable hook(state, bucket), got {hook!r}")
        if any(b.hook is not None for b in self.buckets):
            raise RuntimeError("a communication hook is already registered on this DDP (register it once)")
        for b in self.buckets:
            b.hook = (state, hook)

    def memory_stats(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds: parameters (masters), gradients, optimizer_state (0 without `optimizer`),
        working_parameters (MixedPrecision copies alive now), buckets (the flat reduction buffers), current (their
        sum) and peak (current with the working copies and their low-precision gradients, alive during a step)."""
        params = list(self.module.parameters())
        working = self.working.nbytes()
        stats = {
            "parameters": sum(int(self.working.master(p).nbytes) for p in params),
            "gradients": sum(int(p.grad.nbytes) for p in params if p.grad is not None),
            "optimizer_state": optimizer_state_bytes(optimizer),
            "working_parameters": working,
            "buckets": sum(b.nbytes for b in self.buckets),
        }
        stats["current"] = sum(stats.values())
        itemsize = np.dtype(self.working.dtype).itemsize if self.working.params else 0
        low = sum(p.size for p in self.working.params) * itemsize
        stats["peak"] = stats["current"] - working + 2 * low  # working copies + their gradients until reduced
        return stats

    def remove_hooks(self) -> None:
        """Detach DDP from the module's parameters (the module can then be used on its own again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def extra_repr(self) -> str:
        return f"buckets={len(self.buckets)}, strategy={self.config.strategy.name}"


DDP = DistributedDataParallel
