"""The gradient reduction of FSDP on virtual ranks (`DistributedTrainer(parallel="fsdp")` in a live job): a
reduce-scatter defined on virtual ranks.

Each rank computes one gradient row per virtual rank it carries (as `axond.train.virtual`), padded like the flat
buffer of `axond.parallel.fsdp.virtual.VirtualFSDP`. One all_to_all sends every destination rank, from each of this
rank's rows, the elements of the blocks of virtual shards it is routed (its own block, and those of the ranks whose
buddy it is), and every row's loss. Each rank then sums what it received in the order v = 0, 1, ..., V - 1 and divides
by V, per element: the bits of the all_gather-and-sum of `parallel="ddp"` on those elements, at any world size, while
each rank receives only its blocks. The global gradient norm (for `clip_norm`) is the square root of the per-virtual-
shard sums of squares (float64, each over one shard), added in shard order after one all_reduce in which every entry
is non-zero on one rank only (exact); clipping scales the reduced blocks before the step is committed, so applying a
step after a re-formation (rolling forward) needs no collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.parallel.fsdp.virtual import VirtualFSDP
from axond.parallel.zero.virtual import carried
from axond.train.virtual import LOSS_BYTES, VirtualGradients, owners


class ShardedGradients(VirtualGradients):
    """The rows of the virtual ranks this rank carries, reduce-scattered over the group in virtual-rank order into
    `fsdp.incoming` (see the module docstring)."""

    def __init__(self, params: Sequence[Parameter], fsdp: VirtualFSDP, deterministic: bool = True,
                 clip_norm: float | None = None) -> None:
        if not deterministic:
            raise ValueError("parallel='fsdp' on virtual ranks reduces the gradients in virtual-rank order only "
                             "(deterministic=True); use parallel='ddp' or 'zero' for the fast mode")
        super().__init__(params, fsdp.virtual, deterministic)
        self.fsdp = fsdp
        self.clip_norm = clip_norm
        self.size = fsdp.layout.padded_numel  # rows padded like the flat buffer; the loss bytes after the padding
        self.out = fsdp.incoming
        self.norm = 0.0
        """The global gradient norm of the last reduction (before clipping)."""
        self.norms = np.zeros(fsdp.virtual, np.float64)
        self.squares = np.empty(fsdp.shard, np.float64)
        self._routes: list[list[range]] | None = None

    def layout(self, group: ProcessGroup) -> None:
        """Carry this rank's block of virtual ranks in `group` (again after every re-formation)."""
        self.group = group
        self.mine = carried(group.rank, group.size, self.virtual)
        self.table = owners(group.size, self.virtual)
        self.width = math.ceil(self.virtual / group.size)
        self.rows = np.zeros((self.width, self.size + self.extra), self.dtype)
        self._routes = None  # the send buffer follows the routes, set once the shards are placed in this group

    def _prepare(self) -> None:
        """The exact split sizes of the all_to_all: to each destination, each row this rank carries cut to the blocks
        it is routed (and the loss); from each source, its rows cut to this rank's blocks. No padding row or column."""
        f = self.fsdp
        assert self.group is not None and f.group.size == self.group.size, "the shards are placed in another group"
        self._routes = f.routes
        world, me = self.group.size, self.group.rank
        carries = [len(carried(r, world, self.virtual)) for r in range(world)]
        self.counts = [sum(len(b) for b in blocks) * f.shard + self.extra for blocks in f.routes]
        self.chunk = max(self.counts)
        """The widest row sent: the largest routed block and the loss."""
        self.ins = [carries[me] * c for c in self.counts]
        self.outs = [carries[src] * self.counts[me] for src in range(world)]
        self.send = np.zeros(sum(self.ins), self.dtype)
        starts = np.cumsum([0, *self.ins])
        self.to = [self.send[starts[d] : starts[d + 1]].reshape(carries[me], self.counts[d]) for d in range(world)]
        self.froms = np.cumsum([0, *self.outs])
        self.carries = carries

    def gather(self) -> None:
        """The collective: the reduce-scatter, the ordered mean into `fsdp.incoming` on this rank's routed blocks, the
        losses, the norm and the clipping (no state changes elsewhere: a failure here leaves the step unapplied)."""
        assert self.group is not None, "layout() first"
        f = self.fsdp
        if self._routes is not f.routes:
            self._prepare()
        mine = len(self.mine)
        for dest, blocks in enumerate(f.routes):
            at, to = 0, self.to[dest]
            for block in blocks:
                span = f.span(block)
                n = span.stop - span.start
                to[:, at : at + n] = self.rows[:mine, span]
                at += n
            to[:, at : at + self.extra] = self.rows[:mine, self.size :]
        flat = np.asarray(self.group.all_to_all(self.send, input_split_sizes=self.ins, output_split_sizes=self.outs))
        width = self.counts[self.group.rank]
        got = [flat[self.froms[r] : self.froms[r + 1]].reshape(self.carries[r], width) for r in range(self.group.size)]
        at = 0
        first, rest = self.table[0], self.table[1:]
        for block in f.reduced:
            span = f.span(block)
            n = span.stop - span.start
            out = self.out[span]
            np.copyto(out, got[first[0]][first[1], at : at + n])
            for r, row in rest:
                np.add(out, got[r][row, at : at + n], out=out)
            np.divide(out, out.dtype.type(self.virtual), out=out)
            at += n
        for v, (r, row) in enumerate(self.table):
            self.losses[v] = got[r][row, at : at + self.extra].view(np.uint8)[:LOSS_BYTES].view(np.float64)
        if self.clip_norm is not None:
            self._clip(self.clip_norm)

    def _clip(self, max_norm: float) -> None:
        """The global norm from per-virtual-shard sums of squares (collective), then this rank's reduced blocks scaled
        as `clip_grad_norm_` scales."""
        assert self.group is not None
        f = self.fsdp
        self.norms[:] = 0.0
        for v in f.mine:
            np.square(self.out[f.span(range(v, v + 1))], out=self.squares)
            self.norms[v] = self.squares.sum()
        self.group.all_reduce(self.norms)
        total = 0.0
        for v in range(self.virtual):  # in shard order: the same float sum at any world size
            total += float(self.norms[v])
        self.norm = math.sqrt(total)
        coef = max_norm / (self.norm + 1e-6)
        if coef < 1.0:
            for block in f.reduced:
                self.out[f.span(block)] *= coef

    def apply(self) -> None:
        """Nothing to attach: `VirtualFSDP.step` reads `fsdp.incoming` (no rank holds the whole gradient)."""
