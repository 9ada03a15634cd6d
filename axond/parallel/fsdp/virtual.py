"""FSDP on virtual ranks (`VirtualFSDP`): parameters, gradients and optimizer state cut into `virtual` shards, carried
in blocks by the ranks, so that a live job's arithmetic does not depend on its world size.

The layout is ZeRO-1's on virtual ranks (`axond.parallel.zero.virtual`): one flat buffer of every parameter, padded and
cut into `virtual` equal shards; physical rank r of W carries the contiguous block `carried(r, W, virtual)`, holds
the optimizer state of those shards only, and is the authority for their parameters. What FSDP adds:

- **Gradients are reduce-scattered, not gathered whole.** Each rank receives, for its block only (and for the blocks
  of the ranks whose buddy it is, `route`), every virtual rank's gradient rows, and sums them in the order
  v = 0, 1, ..., virtual - 1 (`axond.train.sharded`): the same float operations in the same order at any world size,
  a world size's worth fewer bytes than the all_gather of `parallel="zero"`. No rank holds the whole gradient.
- **The global gradient norm from per-shard partial norms**, each summed over one virtual shard (float64) and added
  in virtual-shard order, so clipping scales by the same factor at any world size.
- **Parameters gathered for the forward and backward.** After its optimizer step each rank's updated block is
  all-gathered into the flat buffer the model's parameters view (`publish`): the all-gather FSDP runs before the next
  forward, done at the end of the step so that the buffer is whole at every step boundary (where buddy copies,
  checkpoints and a joining rank read it). The flat buffer is one allocation reused every step.

A membership change moves whole virtual shards exactly as under ZeRO-1: buddy copies (`axond.train.buddy`), the
worker daemon's copy (`axond.train.daemon_copy`) and re-sharding (`axond.train.reassemble`) work on this class as on
`VirtualZero`, of which it is a subclass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.nn.optim import Optimizer
from axond.parallel.zero.virtual import VirtualZero, carried


class VirtualFSDP(VirtualZero):
    """Wrap `optimizer_class(shards, **defaults)`: each rank of `group` steps its block of `virtual` shards from the
    reduce-scattered gradient in `incoming` (see the module docstring)."""

    def __init__(self, params: Iterable[Parameter], optimizer_class: type[Optimizer], group: ProcessGroup,
                 virtual: int, **defaults: Any) -> None:
        self.routes: list[list[range]] = []
        self.reduced: list[range] = []
        super().__init__(params, optimizer_class, group, virtual, **defaults)
        self.incoming = np.zeros(self.layout.padded_numel, self.flat.dtype)
        """The averaged (clipped) gradient of the step being committed, valid on the blocks in `reduced` only. Apart
        from `grad` (the last applied step's, which buddies keep views of) until the step is applied."""

    def place(self, group: ProcessGroup, states: dict[int, dict[str, Any]] | None) -> None:
        super().place(group, states)
        self.route(None)

    def route(self, buddy: Sequence[int] | None) -> None:
        """Which blocks each rank of the group receives the reduced gradient of: its own, and (`buddy`: each rank's
        buddy, `axond.train.buddy.buddies`) the blocks of the ranks whose buddy it is, so that a buddy holds the
        gradient its copies are advanced by, as under ZeRO-1."""
        world = self.group.size
        self.routes = []
        for dest in range(world):
            blocks = [carried(dest, world, self.virtual)]
            if buddy is not None:
                blocks += [carried(src, world, self.virtual) for src in range(world)
                           if buddy[src] == dest and src != dest]
            self.routes.append(blocks)
        self.reduced = self.routes[self.group.rank]

    def step(self) -> None:
        """Update this rank's shards from `incoming`; local. The reduced blocks (its own and its buddy sources') become
        `grad`, the last applied step's gradient."""
        self.rebind()
        diverted = {(span.start, span.stop): buf for span, buf in self._diverted()}  # (raises before `grad` changes)
        self.holes = []
        for block in self.reduced:
            span = self.span(block)
            buf = diverted.get((span.start, span.stop))
            np.copyto(buf if buf is not None else self.grad[span], self.incoming[span])
            if buf is not None:  # (a span not reduced here is never kept: its buffer was not written)
                self.holes.append((span, buf))
        for shard, v in zip(self.shards, self.mine):
            shard.grad = self.grad[self.span(range(v, v + 1))]
        self.optim.step()
        self.tag += 1
        self.grad_tag = self.tag

