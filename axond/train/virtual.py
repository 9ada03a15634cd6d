"""Virtual data-parallel ranks: the arithmetic of a step defined on a fixed number of ranks, whatever the world size.

A job fixes `virtual` data-parallel ranks for its whole life. Virtual rank v reads shard v of the data and its own
random stream; physical rank r of a world of W carries the contiguous block `carried(r, W, virtual)`. The gradients
of the virtual ranks travel whole (one all_gather of a row per carried virtual rank) and are summed in the order
v = 0, 1, ..., virtual - 1 on every rank, then divided by `virtual`: the same float operations in the same order
at any world size, so the parameters after each step are bit for bit those of a run at any other world size.
The fast mode (`deterministic=False`) sums each rank's own rows first and all_reduces the sums: a world size's
worth fewer bytes, but the order of the float sums follows the world size and the backend's algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.parallel.zero.virtual import carried

LOSS_BYTES = 16
"""Bytes at the end of each row: the virtual rank's loss sum and sample count (two float64, sent as raw bytes)."""


def owners(world: int, virtual: int) -> list[tuple[int, int]]:
    """For each virtual rank v: (the physical rank that carries it, its row in that rank's block)."""
    table: list[tuple[int, int]] = []
    for rank in range(world):
        table.extend((rank, row) for row in range(len(carried(rank, world, virtual))))
    return table


def ordered_mean(gathered: np.ndarray, table: Sequence[tuple[int, int]], out: np.ndarray) -> np.ndarray:
    """`out` = (row of v=0 + row of v=1 + ... + row of v=V-1) / V, summed in that order (rows of `gathered`,
    shaped (world, width, n), found through `table` = `owners(world, V)`); in place, returns `out`."""
    first = table[0]
    np.copyto(out, gathered[first[0], first[1], : out.shape[0]])
    for r, row in table[1:]:
        np.add(out, gathered[r, row, : out.shape[0]], out=out)
    np.divide(out, out.dtype.type(len(table)), out=out)
    return out


class VirtualGradients:
    """The gradient rows of the virtual ranks this rank carries, gathered from every rank and averaged in order."""

    def __init__(self, params: Sequence[Parameter], virtual: int, deterministic: bool = True) -> None:
        dtypes = {p.data.dtype for p in params}
        if len(dtypes) != 1 or not all(isinstance(p.data, np.ndarray) for p in params):
            raise ValueError(f"virtual data-parallel ranks need host (NumPy) parameters of one dtype, got {dtypes}")
        self.params = list(params)
        self.virtual = virtual
        self.deterministic = deterministic
        self.dtype = np.dtype(dtypes.pop())
        self.offsets = np.cumsum([0] + [p.data.size for p in self.params]).tolist()
        self.size = int(self.offsets[-1])
        self.extra = -(-LOSS_BYTES // self.dtype.itemsize)
        self.out = np.empty(self.size, self.dtype)
        """The averaged gradient of the last gather (the parameters' `.grad` are views of it once applied)."""
        self.losses = np.zeros((virtual, 2), np.float64)
        """Per virtual rank: (loss sum, samples) of the last gathered step."""
        self.group: ProcessGroup | None = None
        self.mine = range(0)
        self.table: list[tuple[int, int]] = []

    def layout(self, group: ProcessGroup) -> None:
        """Carry this rank's block of virtual ranks in `group` (again after every re-formation)."""
        self.group = group
        self.mine = carried(group.rank, group.size, self.virtual)
        self.table = owners(group.size, self.virtual)
        width = math.ceil(self.virtual / group.size)
        self.rows = np.zeros((width, self.size + self.extra), self.dtype)
        self.gathered = np.empty((group.size, width, self.size + self.extra), self.dtype)

    def capture(self, row: int, loss_sum: float, samples: int) -> None:
        """Copy the parameters' gradients (zeros where None) and the loss into row `row` of this rank's block."""
        dest = self.rows[row]
        for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:]):
            if p.grad is None:
                dest[lo:hi] = 0
            else:
                dest[lo:hi] = p.grad.reshape(-1)
        tail = dest[self.size :].view(np.uint8)[:LOSS_BYTES].view(np.float64)
        tail[0], tail[1] = loss_sum, samples

    def gather(self) -> None:
        """The collective: every rank's rows, then the ordered mean into `out` and the losses (no state changes
        elsewhere: a failure here leaves the step unapplied)."""
        assert self.group is not None, "layout() first"
        if not self.deterministic:
            self._reduce_fast()
            return
        self.group.all_gather(self.rows, out=self.gathered)
        ordered_mean(self.gathered, self.table, self.out)
        for v, (r, row) in enumerate(self.table):
            self.losses[v] = self.gathered[r, row, self.size :].view(np.uint8)[:LOSS_BYTES].view(np.float64)

    def _reduce_fast(self) -> None:
        """The fast mode: this rank's rows summed, all_reduced, divided; the losses all_reduced exactly (each virtual
        rank's row is non-zero on one rank only)."""
        assert self.group is not None
        np.copyto(self.out, self.rows[0, : self.size])
        for row in range(1, len(self.mine)):
            np.add(self.out, self.rows[row, : self.size], out=self.out)
        self.group.all_reduce(self.out)
        np.divide(self.out, self.out.dtype.type(self.virtual), out=self.out)
        self.losses[:] = 0.0
        for row, v in enumerate(self.mine):
            self.losses[v] = self.rows[row, self.size :].view(np.uint8)[:LOSS_BYTES].view(np.float64)
        self.group.all_reduce(self.losses)

    def apply(self) -> None:
        """Make `out` the parameters' gradients (views, no copy)."""
        for p, lo, hi in zip(self.params, self.offsets, self.offsets[1:]):
            p.grad = self.out[lo:hi].reshape(p.data.shape)
