"""DDP communication hooks (torch's shape): `hook(state, bucket) -> future` reduces one gradient bucket.

`DDP.register_comm_hook(state, hook)` replaces the default AVG all_reduce of each bucket. `state` is what the
hook needs (here: the process group, or None for DDP's own); `bucket` is a `GradBucket` whose `buffer()` holds
the bucket's flat gradients; the hook starts the communication and returns a `HookFuture` whose `wait()` gives
the averaged buffer (written back into `.grad` by DDP). `bf16_compress_hook` and `fp16_compress_hook` send
half the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.distributed.numerics.reduce_op import ReduceOp
from axond.distributed.numerics.bf16 import bfloat16
from axond.nn.device import Array
from axond.nn.module import Parameter

FP16_TINY = float(np.finfo(np.float16).tiny)
"""float16's smallest normal (6.1e-5): smaller values would become subnormals, which NumPy converts on a slow path."""


class HookFuture:
    """The pending result of a hook: `wait()` finishes the communication and returns the reduced buffer."""

    def __init__(self, work: Any, result: Callable[[], Array]) -> None:
        self._work = work
        self._result = result

    def wait(self, timeout: float | None = None) -> Array | None:
        """The reduced buffer, or None if the communication did not finish within `timeout` seconds."""
        if self._work is not None and self._work.wait(timeout) is False:
            return None
        return self._result()

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


class GradBucket:
    """What a hook sees of one gradient bucket (torch's `dist.GradBucket` methods)."""

    def __init__(self, index: int, buffer: Array, params: list[Parameter], last: bool, group: Any) -> None:
        self._index, self._buffer, self._params, self._last, self.group = index, buffer, params, last, group

    def index(self) -> int:
        return self._index

    def buffer(self) -> Array:
        """The flat gradients (then one has-a-gradient flag per parameter): average these."""
        return self._buffer

    def parameters(self) -> list[Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._last


CommHook = Callable[[Any, GradBucket], HookFuture]


def allreduce_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """DDP's default: AVG all_reduce of the buffer in place."""
    group = state if state is not None else bucket.group
    buf = bucket.buffer()
    return HookFuture(group.all_reduce(buf, op=ReduceOp.AVG, async_op=True), lambda: buf)


def _compress_hook(state: Any, bucket: GradBucket, low: Array) -> HookFuture:
    group = state if state is not None else bucket.group
    buf = bucket.buffer()
    work = group.all_reduce(low, op=ReduceOp.AVG, async_op=True)  # summed in float32, rounded once

    def done() -> Array:
        np.copyto(buf, low, casting="unsafe")
        return buf
    return HookFuture(work, done)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """Cast the bucket to bfloat16 (float32's range, so nothing overflows or flushes), average, cast back."""
    return _compress_hook(state, bucket, bucket.buffer().astype(bfloat16()))


def fp16_compress_hook(state: Any, bucket: GradBucket) -> HookFuture:
    """Cast the bucket to float16, average, cast back. Values under float16's smallest normal are flushed to
    zero first: they would lose most bits as subnormals anyway, and NumPy converts subnormals ~15x slower."""
    buf = bucket.buffer()
    tiny = np.abs(buf) < FP16_TINY
    if tiny.any():
        buf = buf.copy()
        buf[tiny] = 0
    return _compress_hook(state, bucket, buf.astype(np.float16))
