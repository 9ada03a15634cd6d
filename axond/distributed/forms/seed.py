"""Seed-compatible names: thin aliases over the process-group API (pg=None means the default group)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from axond.distributed import api
from axond.distributed.backends.base import Array
from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp


def _pg(pg: ProcessGroup | None) -> ProcessGroup:
    return pg if pg is not None else api.default_group()


def _all_reduce(x: Array, pg: ProcessGroup | None, op: ReduceOp) -> Array:
    _pg(pg).all_reduce(x, op)
    return x


def all_reduce_sum(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Sum `x` over the group in place; returns `x`."""
    return _all_reduce(x, pg, ReduceOp.SUM)


def all_reduce_mean(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Average `x` over the group in place; returns `x`."""
    return _all_reduce(x, pg, ReduceOp.AVG)


def all_reduce_min(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Element-wise minimum over the group, in place; returns `x`."""
    return _all_reduce(x, pg, ReduceOp.MIN)


def all_reduce_max(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Element-wise maximum over the group, in place; returns `x`."""
    return _all_reduce(x, pg, ReduceOp.MAX)


def all_reduce_product(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Element-wise product over the group, in place; returns `x`."""
    return _all_reduce(x, pg, ReduceOp.PRODUCT)


def broadcast_from(x: Array, pg: ProcessGroup | None = None, src: int = 0) -> Array:
    """Copy group rank `src`'s `x` into `x` everywhere; returns `x`."""
    _pg(pg).broadcast(x, src)
    return x


def reduce_scatter_sum(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Sum over the group and return this rank's block of rows."""
    return _pg(pg).reduce_scatter(x, ReduceOp.SUM)


def reduce_scatter_mean(x: Array, pg: ProcessGroup | None = None) -> Array:
    """Average over the group and return this rank's block of rows."""
    return _pg(pg).reduce_scatter(x, ReduceOp.AVG)


def gather_tensor(x: Array, pg: ProcessGroup | None = None, dst: int = 0) -> Array | None:
    """(size, *x.shape) on group rank `dst`, None elsewhere."""
    return _pg(pg).gather(x, dst)


def scatter_tensor(x: Array | None, pg: ProcessGroup | None = None, src: int = 0) -> Array:
    """This rank's slice of group rank `src`'s (size, ...) array."""
    return _pg(pg).scatter(x, src)


def sync_gradient(g: Array, pg: ProcessGroup | None = None) -> Array:
    """Average one gradient over the group, written back into `g`; returns `g`."""
    return _all_reduce(g, pg, ReduceOp.AVG)


def sync_gradients(gs: Sequence[Array], pg: ProcessGroup | None = None) -> list[Array]:
    """Average many gradients with one all-reduce per dtype (fused flat buffer), written back into each array."""
    group = _pg(pg)
    by_dtype: dict[np.dtype, list[Array]] = {}
    for g in gs:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, arrays in by_dtype.items():
        flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) if arrays else np.empty(0, dtype)
        group.all_reduce(flat, ReduceOp.AVG)
        offset = 0
        for a in arrays:
            a[...] = flat[offset : offset + a.size].reshape(a.shape)
            offset += a.size
    return list(gs)


def rank(pg: ProcessGroup | None = None) -> int:
    """This process's rank in the group."""
    return _pg(pg).rank


def world_size(pg: ProcessGroup | None = None) -> int:
    """Number of members of the group."""
    return _pg(pg).size


def is_main_process(pg: ProcessGroup | None = None) -> bool:
    """Whether this is rank 0 of the group."""
    return _pg(pg).rank == 0


class World:
    """The initialised world as an object (seed API): its default group and subgroups."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self._group = group

    @classmethod
    def mock(cls, timeout: float = 60.0) -> World:
        """A world of one rank on the in-process "mock" backend (`ProcessGroup.mock`): for unit tests, no socket."""
        return cls(ProcessGroup.mock(timeout))

    def default_group(self) -> ProcessGroup:
        return _pg(self._group)

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup:
        return self.default_group().new_group(ranks)

    def rank(self) -> int:
        return self.default_group().rank

    def world_size(self) -> int:
        return self.default_group().size
