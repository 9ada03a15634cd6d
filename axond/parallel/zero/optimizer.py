"""`ZeroRedundancyOptimizer` (ZeRO-1): every rank keeps optimizer state for 1/N of the parameters only.

The parameters (per dtype and device) move into one flat buffer cut into N equal shards, with the
same `FlatLayout` FSDP uses: each parameter's `.data` becomes a view of it, and this rank's shard
`Parameter` is a view too. `step()` copies this rank's slice of the gradients, lets the wrapped
optimizer update the shard in place, then all-gathers the shards in place into the flat buffer,
which is every parameter at once: no second copy of the parameters is kept.

Gradients: by default `step()` expects them already averaged over the group (DDP does that, as
with torch's ZeroRedundancyOptimizer) and reads only this rank's slice. With
`average_gradients=True` it reduce-scatters (AVG) the local gradients itself, so it can be used
without DDP and moves half the bytes of an all-reduce; `.grad` then stays the local gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from axond.distributed.process_group import ProcessGroup
from axond.nn.device import Array, array_module, device_of, empty_on
from axond.nn.module import Parameter
from axond.nn.optim import AdamW, Optimizer
from axond.parallel.fsdp.comm import GroupLike, all_gather_shards, default_group, reduce_scatter_shards
from axond.parallel.fsdp.flat_param import FlatLayout
from axond.parallel.optimizer_state import optimizer_state_bytes


class _Bucket:
    """Parameters of one dtype and device, moved into one padded flat buffer; this rank's shard is a view of it."""

    def __init__(self, params: list[Parameter], world: int, rank: int) -> None:
        self.params = params
        self.layout = FlatLayout([p.shape for p in params], world)
        self.start, self.stop = self.layout.shard_range(rank)
        self.flat = self.layout.flatten([p.data for p in params], params[0].data)
        self.views = self.layout.views(self.flat)
        for p, view in zip(params, self.views):
            p.data = view
        self.shard = Parameter(self.flat[self.start : self.stop])
        self.grad: Array | None = None

    def rebind(self) -> None:
        """Re-attach parameters whose `.data` was replaced (e.g. by `load_state_dict`) to the flat buffer."""
        for p, view in zip(self.params, self.views):
            if p.data is not view:
                view[...] = p.data
                p.data = view

    def shard_grad(self) -> Array:
        """A reusable buffer for this rank's slice of the gradients."""
        if self.grad is None:
            self.grad = empty_on(self.flat, self.layout.shard_numel, self.flat.dtype)
        return self.grad


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap `optimizer_class(params, **defaults)` so that each rank of `group` steps and stores only its shard."""

    def __init__(
        self,
        params: Iterable[Parameter],
        optimizer_class: type[Optimizer] = AdamW,
        group: ProcessGroup | None = None,
        *,
        average_gradients: bool = False,
        **defaults: Any,
    ) -> None:
        super().__init__(params, defaults)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be an axond.nn.optim.Optimizer subclass, got {optimizer_class!r}")
        self.group: GroupLike = group if group is not None else default_group()
        self.average_gradients = average_gradients
        kinds: dict[tuple[str, str], list[Parameter]] = {}
        for p in self.params:
            kinds.setdefault((str(p.dtype), str(device_of(p.data))), []).append(p)
        self.buckets = [_Bucket(ps, self.group.size, self.group.rank) for ps in kinds.values()]
        self.optim = optimizer_class([b.shard for b in self.buckets], **defaults)
        """The wrapped optimizer, over one shard Parameter per bucket."""
        self.defaults = self.optim.defaults
        self.state = self.optim.state

    @property
    def local_numel(self) -> int:
        """Parameter elements whose optimizer state this rank holds (ceil(numel / N) per bucket)."""
        return sum(b.shard.size for b in self.buckets)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds: parameters (the flat buffers), gradients (`.grad`s and the shard's slice),
        optimizer_state (this rank's shard of it), current (their sum), peak (with the flat gradient copy
        `average_gradients` reduce-scatters)."""
        grads = sum(int(p.grad.nbytes) for p in self.params if p.grad is not None)
        stats = {
            "parameters": sum(int(b.flat.nbytes) for b in self.buckets),
            "gradients": grads + sum(int(b.grad.nbytes) for b in self.buckets if b.grad is not None),
            "optimizer_state": optimizer_state_bytes(self.optim),
        }
        stats["current"] = sum(stats.values())
        flat_copy = sum(int(b.flat.nbytes) for b in self.buckets) if self.average_gradients else 0
        stats["peak"] = stats["current"] + flat_copy
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optim.zero_grad(set_to_none)

    def step(self) -> None:
        """Update this rank's shard with the wrapped optimizer, then all-gather the shards into the parameters."""
        for b in self.buckets:
            b.rebind()
            grads = [p.grad for p in b.params]
            if self.average_gradients:
                full = b.layout.flatten(grads, b.flat)
                b.shard.grad = b.shard_grad()
                reduce_scatter_shards(full, b.shard.grad, self.group)
            elif all(g is None for g in grads):
                b.shard.grad = None
            else:
                b.shard.grad = b.layout.copy_range(grads, b.start, b.stop, b.shard_grad())
        self.optim.step()
        for b in self.buckets:
            all_gather_shards(b.shard.data, b.flat, self.group)

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state (collective): full-length flat state per bucket, the same on every rank.

        Loadable by a ZeroRedundancyOptimizer over the same parameters on any number of ranks.
        """
        inner = self.optim.state_dict()
        state: dict[str, Any] = {}
        for key, value in inner["state"].items():
            b = self.buckets[int(key.split(".", 1)[0])]
            if hasattr(value, "shape") and tuple(value.shape) == (b.layout.shard_numel,):
                full = empty_on(value, b.layout.padded_numel, value.dtype)
                all_gather_shards(value, full, self.group)
                state[key] = full[: b.layout.numel].copy()
            else:
                state[key] = value
        return {"defaults": dict(inner["defaults"]), "state": state, "numels": [b.layout.numel for b in self.buckets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a consolidated `state_dict()`, keeping this rank's shard of every state array."""
        numels = [b.layout.numel for b in self.buckets]
        if list(state.get("numels", [])) != numels:
            raise ValueError(f"ZeroRedundancyOptimizer state is for flat buckets of {state.get('numels')} elements, "
                             f"these parameters make {numels}: load it over the same parameters")
        sharded: dict[str, Any] = {}
        for key, value in state["state"].items():
            b = self.buckets[int(key.split(".", 1)[0])]
            if hasattr(value, "shape") and tuple(value.shape) == (b.layout.numel,):
                full: Array = array_module(b.shard.data).asarray(value)
                sharded[key] = b.layout.pad_shard(full, self.group.rank)
            else:
                sharded[key] = value
        self.optim.load_state_dict({"defaults": state["defaults"], "state": sharded})
