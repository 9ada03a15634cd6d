"""Gradient buckets and the synchroniser that all-reduces them while backward is still running.

Parameters are assigned to buckets in reverse registration order (roughly the order backward
produces their gradients), split by dtype and device, each bucket at most `bucket_cap_mb`. A
parameter's post-accumulate-grad hook marks it ready; when a bucket's last parameter is ready,
its gradients are packed into one flat buffer and an asynchronous AVG all-reduce starts. Buckets
are launched strictly in index order, so every rank issues the same collectives in the same order.
`finish()` launches whatever is left, waits for every bucket and writes the averages back into `.grad`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import DistributedError
from axond.nn.device import Array, device_of, empty_on
from axond.nn.module import Parameter
from axond.observe import timeline
from axond.parallel.mixed_precision import MixedPrecision
from axond.parallel.ddp.hooks import GradBucket


class Work(Protocol):
    def wait(self, timeout: float | None = None) -> Any: ...

    def is_completed(self) -> bool: ...


class GroupLike(Protocol):
    """What DDP needs of a process group."""

    rank: int
    size: int

    def all_reduce(self, x: Array, op: ReduceOp = ..., async_op: bool = ...) -> Any: ...

    def broadcast(self, x: Array, src: int = ..., async_op: bool = ...) -> Any: ...


class GradientBucket:
    """A flat buffer holding the gradients of a few parameters of one dtype, reduced as one message."""

    def __init__(self, index: int, params: Sequence[Parameter], late: set[int],
                 mixed_precision: MixedPrecision | None = None) -> None:
        if not params:
            raise ValueError("a gradient bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        first = self.params[0].data
        mp = mixed_precision or MixedPrecision()
        self.dtype = mp.reduce(first.dtype)
        """The dtype gradients are reduced in (packing casts into it)."""
        self.grad_dtype = mp.grad(first.dtype)
        """The dtype `.grad` has after the reduction."""
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.size
        self.numel = total
        self.buffer: Array = empty_on(first, total + len(self.params), self.dtype)
        """The gradients, then one has-a-gradient flag per parameter (averaged with them, so that a
        parameter no rank produced a gradient for keeps `.grad = None`, as without DDP)."""
        self.launch_only_at_end = any(id(p) in late for p in self.params)
        """A parameter here is shared between modules, so only the end of backward knows it is final."""
        self.ready: set[int] = set()
        self.work: Work | None = None
        self.future: Any = None
        """A communication hook's `HookFuture` for this pass (instead of `work`)."""
        self.hook: tuple[Any, Any] | None = None
        """(state, hook) registered with `DDP.register_comm_hook`, or None for the AVG all_reduce."""
        self.last = False
        self.launched_at: float | None = None
        self._group_name: str | None = None
        self._group_rank: int | None = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def reset(self) -> None:
        self.ready = set()
        self.work = None
        self.future = None
        self.launched_at = None

    def mark_ready(self, param: Parameter) -> None:
        """Record that `param`'s gradient is final for this pass."""
        if self.work is not None or self.future is not None:
            raise RuntimeError(
                f"a parameter of gradient bucket {self.index} got more gradient after the bucket was sent: "
                "DDP needs each module's backward to run once per DDP.backward"
            )
        self.ready.add(id(param))

    @property
    def complete(self) -> bool:
        """True once the bucket may be launched from a hook."""
        return not self.launch_only_at_end and len(self.ready) == len(self.params)

    def pack(self) -> None:
        """Copy every gradient into the flat buffer (zeros for a parameter that got none) and set the flags."""
        flags = self.buffer[self.numel :]
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            view = self.buffer[off : off + p.size]
            if p.grad is None:
                view.fill(0)
                flags[i] = 0
            else:
                view[...] = p.grad.reshape(-1)
                flags[i] = 1

    def launch(self, group: GroupLike) -> None:
        """Pack and start the asynchronous all-reduce (AVG) of the buffer."""
        self.pack()
        self._group_name = getattr(group, "name", None)
        self._group_rank = getattr(group, "rank", None)
        self.launched_at = time.perf_counter()
        if self.hook is None:
            self.work = group.all_reduce(self.buffer, op=ReduceOp.AVG, async_op=True)
            return
        state, hook = self.hook
        self.future = hook(state, GradBucket(self.index, self.buffer, self.params, self.last, group))

    def wait_and_unpack(self, timeout: float | None) -> None:
        """Wait for the all-reduce, then write the averages back into every parameter's `.grad`."""
        if self.work is None and self.future is None:
            raise RuntimeError(f"gradient bucket {self.index} was never launched")
        if self.future is not None:
            reduced = self.future.wait(timeout)
            finished = reduced is not None
            if finished and reduced is not self.buffer:
                np.copyto(self.buffer, reduced, casting="unsafe")
        else:
            assert self.work is not None
            finished = self.work.wait(timeout) is not False
        if not finished:
            raise DistributedError(
                f"all_reduce of DDP gradient bucket {self.index} ({self.nbytes} bytes) on group '{self._group_name}', "
                f"rank {self._group_rank}: not finished within {timeout} s (a peer is slow, dead or in another op)",
                op="all_reduce",
                group=self._group_name,
                rank=self._group_rank,
            )
        flags = self.buffer[self.numel :].tolist()
        for p, off, used in zip(self.params, self.offsets, flags):
            view = self.buffer[off : off + p.size].reshape(p.shape)
            if p.grad is None:
                if used != 0:
                    p.grad = view.astype(self.grad_dtype)
            elif p.grad.dtype != self.grad_dtype:
                p.grad = view.astype(self.grad_dtype)  # low-precision gradient -> the masters' dtype, one copy
            else:
                p.grad[...] = view
        self.work = None
        self.future = None


def assign_buckets(
    params: Sequence[Parameter], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[Parameter]]:
    """Group `params` (taken in reverse order) into buckets of one dtype and device, at most `cap_bytes` each."""
    buckets: list[list[Parameter]] = []
    open_by_kind: dict[tuple[str, str], tuple[list[Parameter], int]] = {}
    for p in reversed(list(params)):
        kind = (str(p.dtype), str(device_of(p.data)))
        cap = first_cap_bytes if (first_cap_bytes is not None and not buckets) else cap_bytes
        current = open_by_kind.get(kind)
        nbytes = p.size * p.dtype.itemsize
        if current is not None and current[1] + nbytes <= cap:
            current[0].append(p)
            open_by_kind[kind] = (current[0], current[1] + nbytes)
            continue
        bucket = [p]
        buckets.append(bucket)
        open_by_kind[kind] = (bucket, nbytes)
    return buckets


class GradientSynchronizer:
    """Owns the buckets of one DDP wrapper and runs one synchronisation per backward pass."""

    def __init__(
        self,
        params: Sequence[Parameter],
        group: GroupLike,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        timeout: float | None = None,
        shared: set[int] | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        trainable = [p for p in params if p.requires_grad]
        late = shared or set()
        cap = max(1, int(bucket_cap_mb * 2**20))
        first = None if first_bucket_cap_mb is None else max(1, int(first_bucket_cap_mb * 2**20))
        self.group = group
        self.timeout = timeout
        self.buckets = [GradientBucket(i, ps, late, mixed_precision)
                        for i, ps in enumerate(assign_buckets(trainable, cap, first))]
        if self.buckets:
            self.buckets[-1].last = True
        self._bucket_of: dict[int, GradientBucket] = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._armed = False
        self.events: list[tuple[float, str, int]] = []
        """(perf_counter time, event, bucket index or -1) of the current/last pass: launch, reduced, ..."""

    def record(self, event: str, index: int = -1) -> None:
        self.events.append((time.perf_counter(), event, index))

    def prepare(self) -> None:
        """Start a pass: hooks launch buckets from now on."""
        for b in self.buckets:
            b.reset()
        self._next_launch = 0
        self._armed = True
        self.events = []

    def disarm(self) -> None:
        """Stop launching from hooks (a backward that will not be synchronised)."""
        self._armed = False

    def on_grad_ready(self, param: Parameter) -> None:
        """Post-accumulate-grad hook: launch every bucket that is complete, in index order."""
        if not self._armed:
            return
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            return
        bucket.mark_ready(param)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if not b.complete:
                return
            self._launch(b)

    def _launch(self, bucket: GradientBucket) -> None:
        bucket.launch(self.group)
        self._next_launch += 1
        self.record("launch", bucket.index)

    def finish(self) -> None:
        """Launch the buckets not yet sent, wait for all, and write the averages into `.grad`."""
        self._armed = False
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for b in self.buckets:
            b.wait_and_unpack(self.timeout)
            self.record("reduced", b.index)
            if timeline.TRACER is not None and b.launched_at is not None:
                timeline.TRACER.since("ddp.bucket", "ddp", int(b.launched_at * 1e9), index=b.index, bytes=b.nbytes)

    def sync_now(self) -> None:
        """Reduce every bucket right now (outside backward)."""
        self.prepare()
        self._armed = False
        self.finish()
