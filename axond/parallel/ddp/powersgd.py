"""PowerSGD gradient compression for DDP (Vogels et al., 2019), as a communication hook in torch's shape.

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, powerSGD_hook)

For each bucket, every gradient of a parameter with two or more dimensions, viewed as an n x m matrix M (the
first dimension against the rest), is sent as a rank-r approximation when that is at least
`min_compression_rate` times smaller ((n + m) r against n m): with Q (m x r) the same on every rank,

    P = sum over ranks of M Q,   P <- orthonormal columns of P,   Q = (sum over ranks of M^T P) / world size,

and the gradient becomes P Q^T, the average's projection onto the span of P. Everything else in the bucket
(vectors, small matrices, DDP's has-a-gradient flags) is averaged exactly. So r (n + m) numbers per matrix cross
the network instead of n m, in two all-reduces.

- **Error feedback** (`use_error_feedback`): what the approximation left out of this rank's matrix, M - P Q^T,
  is added to the next step's gradient before compressing, so nothing is lost for good, only delayed.
- **Warm start** (`warm_start`): each step starts from the last step's Q (one power iteration per step refines
  it); else from a fresh random Q.
- The first `start_powerSGD_iter` steps are averaged exactly (PowerSGD needs a warmed-up model; torch's advice).
- Determinism: Q is drawn from `random_seed` in the same order on every rank, and the reductions give every
  rank the same bits, so every rank ends with the same gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from axond.distributed.numerics.reduce_op import ReduceOp
from axond.nn.device import Array, array_module
from axond.parallel.ddp.hooks import GradBucket, HookFuture, allreduce_hook


class PowerSGDState:
    """What `powerSGD_hook` keeps across steps: its settings, the step count, each bucket's error and Q."""

    def __init__(self, process_group: Any = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True, random_seed: int = 0) -> None:
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be a positive int, got {matrix_approximation_rank!r}")
        if not isinstance(start_powerSGD_iter, int) or start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be a non-negative int, got {start_powerSGD_iter!r}")
        if not min_compression_rate >= 1.0:
            raise ValueError(f"min_compression_rate must be at least 1, got {min_compression_rate!r}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.rng = np.random.default_rng(random_seed)
        self.iter = 0
        """Steps seen so far (counted at each step's last bucket)."""
        self.error_dict: dict[int, Array] = {}
        """Per bucket: what the last approximation left out of this rank's matrices (flat, the bucket's layout)."""
        self.q_memory_dict: dict[int, list[Array]] = {}
        """Per bucket: the last Q of each compressed matrix (warm start)."""
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after) over every compressed step so far."""
        after = self.total_numel_after_compression
        return (self.total_numel_before_compression / after if after else 0.0,
                self.total_numel_before_compression, after)


@dataclass
class _Matrix:
    start: int
    rows: int
    cols: int
    rank: int


def _layout(state: PowerSGDState, bucket: GradBucket) -> tuple[list[_Matrix], np.ndarray]:
    """The bucket's compressed matrices, and the indices of every other element of its buffer (flags included)."""
    matrices, exact, at = [], [], 0
    r = state.matrix_approximation_rank
    for p in bucket.parameters():
        size = int(p.size)
        if len(p.shape) >= 2:
            n, m = int(p.shape[0]), size // int(p.shape[0])
            k = min(r, n, m)
            if (n + m) * k * state.min_compression_rate < n * m:
                matrices.append(_Matrix(at, n, m, k))
                at += size
                continue
        exact.append(np.arange(at, at + size))
        at += size
    exact.append(np.arange(at, bucket.buffer().size))  # the has-a-gradient flags
    return matrices, np.concatenate(exact)


class _Pending:
    """Two in-flight all-reduces waited for as one (the hook's first round)."""

    def __init__(self, *works: Any) -> None:
        self.works = works

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for w in self.works:
            left = None if end is None else max(0.0, end - time.monotonic())
            if w.wait(left) is False:
                return False
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> HookFuture:  # noqa: N802 -- torch's name
    """Reduce `bucket` as a rank-`matrix_approximation_rank` approximation (see the module's docstring)."""
    group = state.process_group if state.process_group is not None else bucket.group
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)
    buf, index = bucket.buffer(), bucket.index()
    if buf.dtype not in (np.float32, np.float64):
        raise TypeError(f"powerSGD_hook needs float32 or float64 gradient buckets, got {buf.dtype} "
                        "(reduce in float32: MixedPrecision(reduce_dtype=np.float32))")
    xp = array_module(buf)
    matrices, exact_at = _layout(state, bucket)
    exact_at = xp.asarray(exact_at)
    grads = buf[: buf.size - len(bucket.parameters())]
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is not None and error.shape == grads.shape:
            xp.add(grads, error, out=grads)
    compensated = [buf[m.start : m.start + m.rows * m.cols].reshape(m.rows, m.cols) for m in matrices]
    local = [c.copy() for c in compensated] if state.use_error_feedback else []
    qs = [xp.asarray(q) for q in _starting_qs(state, index, matrices, buf.dtype)]
    p_flat = xp.empty(sum(m.rows * m.rank for m in matrices), buf.dtype)
    ps, at = [], 0
    for mat, q, c in zip(matrices, qs, compensated):
        p = p_flat[at : at + mat.rows * mat.rank].reshape(mat.rows, mat.rank)
        xp.matmul(c, q, out=p)
        ps.append(p)
        at += p.size
    exact = buf[exact_at]
    pending = _Pending(group.all_reduce(exact, op=ReduceOp.AVG, async_op=True),
                       group.all_reduce(p_flat, op=ReduceOp.SUM, async_op=True))
    state.total_numel_before_compression += grads.size
    state.total_numel_after_compression += exact.size + p_flat.size + sum(q.size for q in qs)

    def finish() -> Array:
        buf[exact_at] = exact
        q_flat = xp.empty(sum(m.cols * m.rank for m in matrices), buf.dtype)
        new_qs, at = [], 0
        for mat, p, c in zip(matrices, ps, compensated):
            p[...] = xp.linalg.qr(p)[0]  # the same bits on every rank: the same summed P
            q = q_flat[at : at + mat.cols * mat.rank].reshape(mat.cols, mat.rank)
            xp.matmul(c.T, p, out=q)
            new_qs.append(q)
            at += q.size
        if q_flat.size:
            group.all_reduce(q_flat, op=ReduceOp.AVG)
        for p, q, c in zip(ps, new_qs, compensated):
            xp.matmul(p, q.T, out=c)  # the approximation of the average, in place in the bucket
        if state.use_error_feedback:
            error = state.error_dict.get(index)
            if error is None or error.shape != grads.shape:
                error = state.error_dict[index] = xp.zeros_like(grads)
            for mat, mine, c in zip(matrices, local, compensated):
                xp.subtract(mine, c, out=error[mat.start : mat.start + mat.rows * mat.cols].reshape(mine.shape))
        state.q_memory_dict[index] = [q.copy() for q in new_qs]
        return buf

    state.maybe_increase_iter(bucket)
    return HookFuture(pending, finish)


def _starting_qs(state: PowerSGDState, index: int, matrices: list[_Matrix], dtype: np.dtype) -> list[Array]:
    """Each matrix's Q: last step's (warm start) where it fits, else drawn from the state's generator (in the same
    order on every rank, so the same everywhere)."""
    kept = state.q_memory_dict.get(index, []) if state.warm_start else []
    out = []
    for i, mat in enumerate(matrices):
        if i < len(kept) and kept[i].shape == (mat.cols, mat.rank):
            out.append(kept[i])
        else:
            out.append(state.rng.standard_normal((mat.cols, mat.rank)).astype(dtype))
    return out
