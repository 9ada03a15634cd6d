"""`FullyShardedDataParallel`: each rank keeps 1/N of every unit's parameters, gradients and optimizer state.

Hooks on each unit's module gather its full parameters just before they are used (forward, and
for FULL_SHARD again for backward) and free them after; the unit's flat gradient is reduce-scattered
(AVG) into the local shard's `.grad` when its backward ends. `parameters()` returns the shards, so
an ordinary `axond.nn.optim` optimizer built after wrapping steps only this rank's part. A backward
that bypasses `FSDP.backward` (the inner model's own) makes the next step or forward raise.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.nn.device import Array, array_module, device_of, to_device
from axond.nn.module import Module, Parameter, RemovableHandle
from axond.parallel.ddp.comm import broadcast_coalesced
from axond.parallel.fsdp.comm import GroupLike, broadcast_from_first, default_group
from axond.parallel.fsdp.config import CPUOffload, FSDPConfig, ShardingStrategy
from axond.parallel.fsdp import offload
from axond.parallel.fsdp.flat_param import FlatLayout
from axond.parallel.fsdp.order import RunOrder
from axond.parallel.fsdp.stats import MemoryStats
from axond.parallel.fsdp.unit import FSDPUnit
from axond.parallel.fsdp.wrap import UnitPlan, WrapPolicy, install, plan_units, select_unit_modules
from axond.parallel.bypass import BackwardGuard
from axond.parallel.optimizer_state import optimizer_state_bytes
from axond.parallel.mesh import DeviceMesh
from axond.parallel.mixed_precision import MixedPrecision, cast_buffers, check_mixed_precision
from axond.parallel.no_sync import NoSync


def resolve_groups(strategy: ShardingStrategy, group: ProcessGroup | None, mesh: DeviceMesh | None) -> tuple[GroupLike | None, GroupLike | None, int]:
    """(shard group, replicate group, this rank's place in the whole data-parallel group) for `strategy`."""
    if group is not None and mesh is not None:
        raise ValueError("pass either group= or mesh= to FullyShardedDataParallel, not both")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if mesh is None or mesh.ndim != 2:
            raise ValueError(
                "HYBRID_SHARD needs mesh=DeviceMesh((replicas, shard_size)) with 2 dimensions (replicate, shard); "
                f"got mesh={mesh!r}"
            )
        return mesh.get_group(1), mesh.get_group(0), int(mesh.parent.rank)
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"{strategy.name} runs over one group: pass group= or a 1-d mesh (a 2-d mesh is for HYBRID_SHARD); got {mesh!r}")
        group = mesh.get_group(0)
    group = group if group is not None else default_group()
    if strategy is ShardingStrategy.NO_SHARD:
        return None, group, int(group.rank)
    return group, None, int(group.rank)


class FullyShardedDataParallel(NoSync, Module):
    """Shard `module`'s parameters over `group` (or a 2-d `mesh` for HYBRID_SHARD); see the module docstring."""

    def __init__(
        self,
        module: Module,
        group: ProcessGroup | None = None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        cpu_offload: CPUOffload | None = None,
        mesh: DeviceMesh | None = None,
        wrap: WrapPolicy = None,
        *,
        sync_module_states: bool = True,
        forward_prefetch: bool = False,
        backward_prefetch: bool = False,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"FullyShardedDataParallel wraps an axond.nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module is already FSDP-wrapped; choose inner units with wrap= instead of nesting wrappers")
        self.config = FSDPConfig(sharding_strategy, cpu_offload or CPUOffload(), sync_module_states,
                                 forward_prefetch, backward_prefetch)
        self.shard_group, self.replicate_group, self.rank = resolve_groups(sharding_strategy, group, mesh)
        self.module = module
        self.mixed_precision = check_mixed_precision(mixed_precision)
        cast_buffers(module, self.mixed_precision)
        self._sync_enabled = True
        self.stats = MemoryStats()
        self._state_keys = list(module.state_dict().keys())
        plans = plan_units(module, select_unit_modules(module, wrap))
        if sync_module_states:
            self._broadcast_replicated()
        self._copier = self._offload_copier(plans)
        self._units: list[FSDPUnit] = []
        self._hooks: list[RemovableHandle] = []
        self._forward_order, self._backward_order = RunOrder(), RunOrder()
        self._reducing: list[FSDPUnit] = []
        self._guard = BackwardGuard("fsdp", "FullyShardedDataParallel",
                                    "the sharded gradients were not all reduced and may be incomplete or stale")
        for plan in plans:
            self._add_unit(plan)
        self._hooks += self._guard.guard_steps(u.shard for u in self._units)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.config.sharding_strategy

    @property
    def units(self) -> list[FSDPUnit]:
        """The units in creation order (root first), each with its shard, layout and names."""
        return list(self._units)

    def _groups(self) -> list[GroupLike]:
        return [g for g in (self.replicate_group, self.shard_group) if g is not None and g.size > 1]

    def _broadcast_replicated(self) -> None:
        """Buffers and frozen parameters are not sharded: copy rank 0's to everyone."""
        arrays = list(self.module.state_dict().values())
        trainable = {id(p.data) for p in self.module.parameters() if p.requires_grad}
        arrays = [a for a in arrays if id(a) not in trainable]
        for g in self._groups() if arrays else []:
            broadcast_coalesced(arrays, g, src=0)

    def _initial(self, plan: UnitPlan) -> list[Array]:
        """The unit's starting values: rank 0's when `sync_module_states`, else this rank's."""
        datas = [p.data for p in plan.params]
        if not self.config.sync_module_states or not self._groups():
            return datas
        layout = FlatLayout([tuple(a.shape) for a in datas], 1)
        flat = layout.flatten(datas, datas[0])
        for g in self._groups():
            broadcast_from_first(flat, g)
        return layout.views(flat)

    def _offload_copier(self, plans: list[UnitPlan]) -> offload.Copier | None:
        """The copier moving shards between host and GPU (one copy stream per wrapper), or None: no offload asked
        for, or a NumPy model, whose compute device is the host already (CPUOffload is a no-op there)."""
        if not self.config.cpu_offload.enabled or not any(plan.params for plan in plans):
            return None
        device = device_of(next(p.data for plan in plans for p in plan.params))
        return offload.copier_for(device, self.config.cpu_offload.pin_memory)

    def _add_unit(self, plan: UnitPlan) -> None:
        managed = [Parameter(p.data) for p in plan.params]
        unit = FSDPUnit(
            len(self._units), plan.names, managed, self._initial(plan), self.shard_group, self.replicate_group,
            self._copier, self.stats, self.mixed_precision, keep_on_device=not self.config.cpu_offload.offload_params,
        )
        install(plan, managed)
        setattr(self, f"flat_param_{unit.index}", unit.shard)
        self._units.append(unit)
        reshard = self.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

        forward, backward = self._forward_order, self._backward_order

        def pre_forward(m: Module, x: Array) -> None:
            unit.gather(refresh=True)
            nxt = forward.saw(unit)
            if nxt is not None:
                nxt.start_upload()  # offload: the next shard's upload runs beside this unit's compute
                if self.config.forward_prefetch:
                    nxt.prefetch()

        def post_forward(m: Module, x: Array, out: Array) -> None:
            if reshard or not m.training:
                unit.free()

        def pre_backward(m: Module, grad_out: Array) -> None:
            self._guard.noticed_backward()
            unit.gather()
            nxt = backward.saw(unit)
            if nxt is not None and reshard:
                nxt.start_upload()
                if self.config.backward_prefetch:
                    nxt.prefetch()
            unit.prepare_grad()

        def post_backward(m: Module, grad_out: Array, grad_in: Array) -> None:
            overlap = self.config.backward_prefetch
            unit.start_reduce(self._sync_enabled, async_op=overlap)
            unit.free()
            if unit.pending_reduce is not None:
                self._reducing.append(unit)
            while len(self._reducing) > int(overlap):  # at most one in flight: full gradients do not pile up
                self._reducing.pop(0).finish_reduce()
            for u in self._units:
                if u.offload is not None:
                    u.offload.poll()  # the device gradients of finished downloads go back to the pool

        m = plan.module
        self._hooks += [
            m.register_forward_pre_hook(pre_forward), m.register_forward_hook(post_forward),
            m.register_backward_pre_hook(pre_backward), m.register_backward_hook(post_backward),
        ]

    def forward(self, x: Array) -> Array:
        self._guard.check()
        self._forward_order.start()
        for u in self._units:
            u.mark_stale()  # offload: the host shards were stepped or loaded since the last forward
        if self.mixed_precision is not None:
            x = self.mixed_precision.cast_input(x)
        try:
            return self.module(x)
        finally:
            self._forward_order.end()
            for u in self._units:
                if u.pending_gather is not None:  # prefetched for a unit this forward did not run
                    u.free()
                if u.full is None:
                    u.release_upload()  # an upload started for a unit this forward did not run

    def backward(self, grad_out: Array) -> Array:
        """The module's backward; each unit's gradient is reduced into its shard's `.grad` as its backward ends."""
        self._backward_order.start()
        if self.mixed_precision is not None:
            grad_out = self.mixed_precision.cast_input(grad_out)
        ok = False
        try:
            with self._guard.running():
                grad_in = self.module.backward(grad_out)
            for u in self._reducing:
                u.finish_reduce()
            ok = True
            return grad_in
        finally:
            self._backward_order.end()
            if not ok:
                for u in self._reducing:
                    u.pending_reduce = None  # the backward failed: its gradients are not applied
            self._reducing.clear()
            for u in self._units:
                u.free()
                if u.offload is not None:
                    u.offload.poll()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the shards' gradients so that the whole model's gradient norm is at most `max_norm`.

        Collective over the shard group: each rank's part of the norm is summed (max for inf) there,
        so every rank clips by the same factor and returns the same total norm (the norm before clipping).
        `axond.nn.utils.clip_grad_norm_` on `fsdp.parameters()` would see only this rank's shard.
        """
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        part = np.zeros(1, np.float64)
        infinite = norm_type == math.inf
        for g in grads:
            a = array_module(g).abs(g)
            value = float(a.max()) if infinite else float((a.astype(np.float64) ** norm_type).sum())
            part[0] = max(part[0], value) if infinite else part[0] + value
        if self.shard_group is not None and self.shard_group.size > 1:
            self.shard_group.all_reduce(part, op=ReduceOp.MAX if infinite else ReduceOp.SUM)
        total = float(part[0]) if infinite else float(part[0]) ** (1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g *= coef
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and any full gradient accumulated under `no_sync`."""
        super().zero_grad(set_to_none)
        for u in self._units:
            u.drop_full_grad()

    def full_state_dict(self, rank0_only: bool = False) -> OrderedDict[str, Array]:
        """The unwrapped module's state dict with full parameters (copies). Collective: every rank calls it.

        With `rank0_only`, ranks other than 0 get an empty dict (they still take part in the gathers).
        """
        values: dict[str, Array] = {}
        for u in self._units:
            for names, view in zip(u.names, u.layout.views(u.full_copy())):
                arr = view.copy()
                for name in names:
                    values[name] = arr
        live = self.module.state_dict()
        out: OrderedDict[str, Array] = OrderedDict()
        if rank0_only and self.rank != 0:
            return out
        for key in self._state_keys:
            out[key] = values[key] if key in values else live[key].copy()
        return out

    def state_dict(self) -> OrderedDict[str, Array]:
        """`full_state_dict()` on every rank (collective: every rank of the group must call it, like torch's FSDP),
        keyed like the unwrapped module's. For checkpoints use `axond.checkpoint.get_state_dict`, which needs no
        communication and lets every rank save only its shards."""
        return self.full_state_dict()

    def load_state_dict(self, state: Mapping[str, Array], strict: bool = True) -> tuple[list[str], list[str]]:
        """Load a full state dict (the unwrapped module's names) and keep this rank's shard of each unit."""
        missing = [k for k in self._state_keys if k not in state]
        unexpected = [k for k in state if k not in self._state_keys]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} (pass strict=False to ignore)")
        for u in self._units:
            current: list[Array] | None = None
            arrays: list[Array] = []
            for i, (names, shape) in enumerate(zip(u.names, u.layout.shapes)):
                key = next((n for n in names if n in state), None)
                if key is None:
                    current = current if current is not None else u.layout.views(u.full_copy())
                    arrays.append(current[i])
                    continue
                value = state[key]
                if tuple(value.shape) != shape:
                    raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the module expects {shape}")
                target = u.shard.data
                arrays.append(array_module(target).asarray(to_device(value, device_of(target)), dtype=target.dtype))
            u.load(arrays)
        replicated = self.module.state_dict()
        rest = {k: v for k, v in state.items() if k in replicated}
        self.module.load_state_dict(rest, strict=False)
        return missing, unexpected

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """Gather every unit's full parameters into the modules; with `writeback`, in-place edits are kept."""
        for u in self._units:
            u.gather(refresh=True, master=True)
        try:
            yield
        finally:
            for u in self._units:
                if writeback:
                    u.write_back()
                u.free()

    def memory_stats(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds, from the wrapper's own accounting (see docs/mixed-precision.md, docs/fsdp.md).

        parameters/gradients: the persistent shards and their `.grad` (with offload: the host buffers);
        optimizer_state: `optimizer`'s arrays (0 without it); gathered/full_gradients: unsharded buffers alive
        now (peak_* since the last reset); device_shards: device copies of offloaded shards and gradient shards
        not downloaded yet; current and peak: their sum, the peak counting the transient buffers at their joint
        peak. offloaded: the part of current in host memory because of CPUOffload (0 for NumPy models: nothing
        to offload to); device_current/device_peak: current/peak minus it, what the compute device holds.
        """
        params = sum(int(u.shard.data.nbytes) for u in self._units)
        grads = sum(_grad_bytes(u.shard) for u in self._units)
        state = optimizer_state_bytes(optimizer)
        persistent = params + grads + state
        offloaded = self.stats.offloaded_bytes + (state if self._copier is not None else 0)
        current = persistent + self.stats.transient_bytes()
        peak = persistent + self.stats.peak_transient_bytes
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": state,
            "gathered": self.stats.gathered_bytes,
            "peak_gathered": self.stats.peak_gathered_bytes,
            "full_gradients": self.stats.full_grad_bytes,
            "device_shards": self.stats.device_shard_bytes,
            "unsharded_parameters": sum(u.layout.numel * u.dtype.itemsize for u in self._units),
            "current": current,
            "peak": peak,
            "offloaded": offloaded,
            "device_current": current - offloaded,
            "device_peak": peak - offloaded,
        }

    def reset_peak_memory_stats(self) -> None:
        """Start the peaks afresh from what is alive now."""
        self.stats.reset_peaks()

    def to(self, device: Any = None, dtype: Any = None) -> Module:
        """Not supported: the shards and the modules' views would part ways. Move the module before wrapping."""
        raise NotImplementedError("FullyShardedDataParallel.to() is not supported: call module.to(...) before wrapping it")

    def extra_repr(self) -> str:
        return f"strategy={self.sharding_strategy.name}, units={len(self._units)}"


FSDP = FullyShardedDataParallel


def _grad_bytes(shard: Parameter) -> int:
    """Gradient bytes of a shard, without waiting for an offloaded gradient's download."""
    if isinstance(shard, offload.HostShard):
        return shard.grad_bytes()
    return int(shard.grad.nbytes) if shard.grad is not None else 0
