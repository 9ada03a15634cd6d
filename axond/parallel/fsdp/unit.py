"""One FSDP unit: the parameters of some modules flattened into one buffer, of which a rank keeps a shard.

The modules keep computing with ordinary `Parameter`s whose `.data` are views into the unit's full
flat buffer while it is gathered, and empty arrays while it is freed. Their `.grad`s are views into
one flat gradient buffer, so `accumulate_grad` writes straight into what is reduce-scattered.
The trainable `shard` Parameter (1/N of the padded flat buffer) is what the optimizer sees.
With `MixedPrecision`, the shard stays in the model's dtype (the master) and the gathered buffer, the
flat gradient and the reduce-scatter use the compute and reduce dtypes; the casts happen on the
shard-sized side of each collective where they can. With CPU offload (GPU models) the shard is a `HostShard`
in host memory, uploaded for each gather and its gradient downloaded after each reduce-scatter (offload.py).
"""

from __future__ import annotations

from typing import Any

from axond.nn.device import Array, Device, array_module, device_of, empty_on, to_device
from axond.nn.module import Parameter
from axond.observe import timeline
from axond.parallel.mixed_precision import MixedPrecision
from axond.parallel.fsdp.comm import GroupLike, all_gather_shards, all_reduce_mean, reduce_scatter_shards
from axond.parallel.fsdp.flat_param import FlatLayout
from axond.parallel.fsdp.offload import Copier, HostShard, ShardOffload
from axond.parallel.fsdp.stats import MemoryStats

__all__ = ["FSDPUnit", "MemoryStats"]


class FSDPUnit:
    """Flat parameters of one unit: the local shard, and the gather/free/reduce steps around compute."""

    def __init__(
        self,
        index: int,
        names: list[list[str]],
        params: list[Parameter],
        initial: list[Array],
        shard_group: GroupLike | None,
        replicate_group: GroupLike | None,
        copier: Copier | None,
        stats: MemoryStats,
        mixed_precision: MixedPrecision | None = None,
        keep_on_device: bool = False,
    ) -> None:
        self.index = index
        self.names = names
        """Every state-dict name of each parameter (several when a parameter is tied within the unit)."""
        self.params = params
        """The Parameters the modules compute with (views into the gathered buffer)."""
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.stats = stats
        like = initial[0]
        self.dtype = like.dtype
        """The shard's (master) dtype."""
        mp = mixed_precision or MixedPrecision()
        self.compute_dtype = mp.compute(self.dtype)
        self.reduce_dtype = mp.reduce(self.dtype)
        self.grad_dtype = mp.grad(self.dtype)
        self.full_dtype = self.compute_dtype
        """Dtype of `full` while gathered: the compute dtype, or the master's for `gather(master=True)`."""
        self.compute_device: Device = device_of(like)
        self.layout = FlatLayout([tuple(a.shape) for a in initial], shard_group.size if shard_group else 1)
        self.shard_rank = shard_group.rank if shard_group else 0
        shard = self.layout.shard_of(initial, self.shard_rank, like)
        self.offload = ShardOffload(copier, shard, keep_on_device, stats) if copier is not None else None
        """The shard's host copy and transfers when CPU offload is on (GPU models), else None."""
        self.shard: Parameter = HostShard(self.offload) if self.offload is not None else Parameter(shard)
        """This rank's shard: the only persistent copy of the unit's parameters on this rank."""
        self.full: Array | None = None
        self._full_bytes = 0
        """Bytes of `full` counted as gathered (0 when `full` is the shard itself or its kept device copy)."""
        self.full_grad: Array | None = None
        self.pending_gather: Any = None
        """The `Work` of a prefetch (async all_gather into `full`) not waited for yet."""
        self.pending_reduce: tuple[Any, Array] | None = None
        self._reduce_traced = 0
        """When the reduce-scatter started (timeline on), for the fsdp.reduce event."""
        """(Work or None, gradient) of a reduce-scatter started by `start_reduce`, finished by `finish_reduce`."""
        self._grad_views: list[Array] = []
        self._reduce_src: Array | None = None
        """The flat gradient cast to the reduce dtype, while its reduce-scatter runs."""
        self._empty = empty_on(like, 0, self.compute_dtype)
        self.free()
        if shard_group is None:
            self.gather()

    @property
    def sharded(self) -> bool:
        return self.shard_group is not None

    def _compute_shard(self, dtype: Any = None) -> Array:
        """The shard on the compute device in `dtype` (default: the compute dtype); a copy only if either differs."""
        if self.offload is not None:
            src = self.offload.on_device()
        else:
            src = to_device(self.shard.data, self.compute_device)
        dtype = self.compute_dtype if dtype is None else dtype
        return src if src.dtype == dtype else src.astype(dtype)

    def _alloc_full(self, dtype: Any) -> Array:
        full = empty_on(self._empty, self.layout.padded_numel, dtype)
        self._set_full(full, counted=True)
        return full

    def _set_full(self, full: Array, counted: bool) -> None:
        self.full, self.full_dtype = full, full.dtype
        self._full_bytes = int(full.nbytes) if counted else 0
        self.stats.add_gathered(self._full_bytes)

    def start_upload(self) -> None:
        """With offload: start copying the shard to the device now (the next unit's, while this one computes)."""
        if self.offload is not None:
            self.offload.start_upload()

    def mark_stale(self) -> None:
        """With offload: a new forward, the host shard may have been stepped or loaded since the last upload."""
        if self.offload is not None:
            self.offload.mark_stale()

    def release_upload(self) -> None:
        """With offload_params: drop the shard's device copy (after the gather read it, or an unused upload)."""
        if self.offload is not None:
            self.offload.release()

    def prefetch(self) -> None:
        """Start gathering the full parameters in the background (async all_gather); `gather` waits for it.

        Only while nothing is gathered: the shards must not change before the gather is used (the
        wrapper prefetches within one forward or one backward, never across an optimizer step).
        """
        if self.shard_group is None or self.full is not None:
            return
        src = self._compute_shard()
        full = self._alloc_full(self.compute_dtype)
        self.pending_gather = all_gather_shards(src, full, self.shard_group, async_op=True)

    def _wait_gather(self) -> bool:
        """Wait for a prefetch, if one runs; whether there was one."""
        work, self.pending_gather = self.pending_gather, None
        if work is None:
            return False
        work.wait()
        self.release_upload()
        return True

    def gather(self, refresh: bool = False, master: bool = False) -> None:
        """Make the full parameters available to the modules (all_gather of the shards, or a prefetch's result).

        In the compute dtype, or with `master` in the shard's own dtype (summon_full_params: edits written back
        must not round the masters)."""
        traced = timeline.span_start() if timeline.TRACER is not None else 0
        if self._wait_gather():
            refresh = False  # the prefetch was issued after the last optimizer step: it is fresh
        dtype = self.dtype if master else self.compute_dtype
        if master:
            self.mark_stale()  # summon_full_params: the host shard as it is now
        if self.full is not None and self.full_dtype != dtype:
            self._release_full()
            refresh = True
        if self.full is None or refresh:
            src = self._compute_shard(dtype)
            if self.shard_group is None:
                if self.full is not None and src is not self.full:
                    self._release_full()
                if self.full is None:
                    kept = self.offload is not None and self.offload.keep_on_device and src is self.offload.device
                    self._set_full(src, counted=src is not self.shard.data and not kept)
            else:
                full = self.full if self.full is not None else self._alloc_full(dtype)
                all_gather_shards(src, full, self.shard_group)
            self.release_upload()
        assert self.full is not None
        for p, view in zip(self.params, self.layout.views(self.full)):
            p.data = view
        if traced and timeline.TRACER is not None:
            timeline.TRACER.since("fsdp.unshard", "fsdp", traced, unit=self.index)

    def free(self) -> None:
        """Drop the full parameters (sharded strategies only: NO_SHARD keeps them)."""
        if self.shard_group is None and self.full is not None:
            return
        self._wait_gather()  # never drop a buffer the group is still writing into
        self._release_full()
        for p in self.params:
            p.data = self._empty

    def _release_full(self) -> None:
        self.stats.gathered_bytes -= self._full_bytes
        self.full, self._full_bytes = None, 0

    def prepare_grad(self) -> None:
        """Point every module parameter's `.grad` at its slice of the flat gradient (kept across no_sync)."""
        self.finish_reduce()  # a unit run twice in one step: its first reduce-scatter still reads full_grad
        if self.full_grad is None:
            xp = array_module(self._empty)
            self.full_grad = xp.zeros(self.layout.padded_numel, dtype=self.compute_dtype)
            self._grad_views = self.layout.views(self.full_grad)
            self.stats.add_full_grad(int(self.full_grad.nbytes))
        for p, view in zip(self.params, self._grad_views):
            if p.grad is not None and p.grad is not view:
                view += p.grad
            p.grad = view

    def start_reduce(self, sync: bool, async_op: bool = False) -> None:
        """After the unit's backward: reduce-scatter the flat gradient (unless `sync` is False).

        `finish_reduce` (waits for it and) adds the result into `shard.grad`; with `async_op` the
        reduce-scatter runs on the group's communication thread meanwhile, e.g. while the backward of
        the units before this one computes.
        """
        if self.full_grad is None:
            return
        for p, view in zip(self.params, self._grad_views):
            if p.grad is not view:
                raise RuntimeError(
                    f"FSDP unit {self.index}: the gradient of {self.names[self.params.index(p)][0]!r} was replaced "
                    "instead of accumulated; modules must add gradients with Parameter.accumulate_grad"
                )
        if not sync:
            return
        self._reduce_traced = timeline.span_start() if timeline.TRACER is not None else 0
        full = self.full_grad
        if self.reduce_dtype != self.compute_dtype:
            full = self._reduce_src = full.astype(self.reduce_dtype)  # kept until the reduce-scatter is done
            self.stats.add_full_grad(int(full.nbytes))
        if self.shard_group is None:
            self.pending_reduce = (None, full)
        else:
            grad = empty_on(full, self.layout.shard_numel, self.reduce_dtype)
            work = reduce_scatter_shards(full, grad, self.shard_group, async_op=async_op)
            self.pending_reduce = (work if async_op else None, grad)

    def finish_reduce(self) -> None:
        """Wait for `start_reduce`'s reduce-scatter, average over replicas, and add the shard's gradient into `shard.grad`."""
        if self.pending_reduce is None:
            return
        (work, grad), self.pending_reduce = self.pending_reduce, None
        if work is not None:
            work.wait()
        self._drop_reduce_src()
        all_reduce_mean(grad, self.replicate_group)
        if grad.dtype != self.grad_dtype:
            grad = grad.astype(self.grad_dtype)
        if isinstance(self.shard, HostShard):
            self.shard.receive_grad(grad)  # downloaded on the copy stream; the optimizer waits when it reads .grad
        elif self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad
        self.drop_full_grad()
        if self._reduce_traced and timeline.TRACER is not None:
            timeline.TRACER.since("fsdp.reduce", "fsdp", self._reduce_traced, unit=self.index)

    def _drop_reduce_src(self) -> None:
        if self._reduce_src is not None:
            self.stats.full_grad_bytes -= int(self._reduce_src.nbytes)
        self._reduce_src = None

    def drop_full_grad(self) -> None:
        """Forget the unsharded gradient (and the modules' views of it)."""
        self._drop_reduce_src()
        if self.full_grad is not None:
            self.stats.full_grad_bytes -= int(self.full_grad.nbytes)
        self.full_grad = None
        self._grad_views = []
        for p in self.params:
            p.grad = None

    def full_copy(self) -> Array:
        """The unpadded full flat parameters as a new array (collective over the shard group)."""
        self.mark_stale()  # the host shard may have been written (a checkpoint load) since the last upload
        src = self._compute_shard(self.dtype)
        if self.shard_group is None:
            out = src[: self.layout.numel].copy()
        else:
            full = empty_on(src, self.layout.padded_numel, self.dtype)
            all_gather_shards(src, full, self.shard_group)
            out = full[: self.layout.numel]
        self.release_upload()
        return out

    def _before_host_write(self) -> None:
        if self.offload is not None:
            self.offload.before_host_write()
            self.offload.mark_stale()

    def load(self, arrays: list[Array]) -> None:
        """Set this rank's shard from the full arrays of every parameter (no communication)."""
        start, stop = self.layout.shard_range(self.shard_rank)
        self._before_host_write()
        target = self.shard.data
        self.layout.copy_range([to_device(a, device_of(target)) for a in arrays], start, stop, target)

    def write_back(self) -> None:
        """Copy this rank's part of the gathered full buffer into the shard (after in-place edits)."""
        if self.full is None or self.shard_group is None:
            return
        start, stop = self.layout.shard_range(self.shard_rank)
        self._before_host_write()
        self.shard.data[...] = to_device(self.full[start:stop], device_of(self.shard.data))
