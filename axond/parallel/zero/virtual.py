"""ZeRO-1 on virtual ranks (`VirtualZero`): optimizer state cut into `virtual` shards, carried in blocks by the ranks.

The parameters move into one flat buffer (the `FlatLayout` FSDP and ZeRO-1 use) cut into `virtual` equal shards,
not one per physical rank: virtual shard v is the same elements at any world size, and physical rank r of W steps the
optimizer for the contiguous block `carried(r, W, virtual)` of them (`axond.train.virtual`). Every rank holds the
whole averaged gradient (the virtual-rank gather), so `step()` is local: it copies the gradient into a padded flat
buffer and lets one wrapped optimizer per rank update its shards in place (an element-wise optimizer such as AdamW
then computes the same bits as on one process). `publish()` all-gathers the updated blocks into every rank's flat
buffer (which is every parameter at once). A membership change moves whole virtual shards: `place()` takes a new
group and the states of the shards the rank carries there; `pack`/`unpack` turn one shard's parameters and state into
rows (what buddy copies and re-sharding send) and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Parameter
from axond.nn.optim import AdamW, Optimizer
from axond.parallel.fsdp.flat_param import FlatLayout

Schema = tuple[tuple[str, ...], tuple[str, ...]]
"""(names of the state's arrays, names of its scalars) of one shard's optimizer state, sorted."""


def carried(rank: int, world: int, virtual: int) -> range:
    """The virtual ranks (and their shards) physical rank `rank` of `world` carries: a contiguous block, sizes
    differing by at most 1."""
    if not 0 <= rank < world or world > virtual:
        raise ValueError(f"rank {rank} of world size {world} cannot carry {virtual} virtual ranks (need rank < world "
                         f"<= virtual ranks)")
    return range(rank * virtual // world, (rank + 1) * virtual // world)


class VirtualZero(Optimizer):
    """Wrap `optimizer_class(shards, **defaults)` so that each rank of `group` steps its block of `virtual` shards."""

    def __init__(self, params: Iterable[Parameter], optimizer_class: type[Optimizer], group: ProcessGroup,
                 virtual: int, **defaults: Any) -> None:
        super().__init__(params, defaults)
        dtypes = {p.data.dtype for p in self.params}
        if len(dtypes) != 1 or not all(isinstance(p.data, np.ndarray) for p in self.params):
            raise ValueError(f"ZeRO-1 on virtual ranks needs host (NumPy) parameters of one dtype, got {dtypes}")
        self.optimizer_class = optimizer_class
        self.virtual = virtual
        self.layout = FlatLayout([p.shape for p in self.params], virtual)
        self.flat: np.ndarray = self.layout.flatten([p.data for p in self.params], self.params[0].data)
        """Every parameter, padded to `virtual` shards of `layout.shard_numel` (the parameters are views of it)."""
        self.views = self.layout.views(self.flat)
        for p, view in zip(self.params, self.views):
            p.data = view
        self.grad = np.zeros(self.layout.padded_numel, self.flat.dtype)
        """The averaged (clipped) gradient of the last step applied, padded like `flat`."""
        self.tag = 0
        """The global step the state belongs to (every step applied so far)."""
        self.grad_tag = -1
        """The global step whose gradient `grad` holds."""
        self.divert: list[tuple[slice, np.ndarray]] = []
        """Set before a step (`axond.train.buddy.BuddyCopies.before_step`): spans of the gradient the step writes
        straight into the buffer given (the gradients a buddy keeps) instead of into `grad`: kept without a copy."""
        self.holes: list[tuple[slice, np.ndarray]] = []
        """The spans of `grad` the last step diverted, and where their elements are (`whole_grad` fills them)."""
        self.optim: Optimizer = optimizer_class([Parameter(self.flat[:1].copy())], **defaults)
        self.defaults = self.optim.defaults
        self.place(group, None)

    @property
    def shard(self) -> int:
        return self.layout.shard_numel

    def span(self, shards: range) -> slice:
        """The elements of a block of virtual shards in `flat` (and `grad`)."""
        return slice(shards.start * self.shard, shards.stop * self.shard)

    def place(self, group: ProcessGroup, states: dict[int, dict[str, Any]] | None) -> None:
        """Carry this rank's block of shards in `group`, with `states` (by virtual shard; None: fresh state)."""
        self.whole_grad()  # the diverted spans' buffers are the old layout's, reused by the new one
        self.group = group
        self.mine = carried(group.rank, group.size, self.virtual)
        self.shards = [Parameter(self.flat[self.span(range(v, v + 1))]) for v in self.mine]
        defaults = self.defaults
        self.optim = self.optimizer_class(self.shards, **defaults)
        self.optim.defaults = defaults  # one dict: a learning-rate change reaches every rebuilt optimizer
        self.defaults = defaults
        if states is not None:
            self.optim.state = [dict(states[v]) for v in self.mine]
        init_state(self.optim)
        self.state = self.optim.state
        self.width = -(-self.virtual // group.size)
        self.sendbuf = np.empty(self.width * self.shard, self.flat.dtype)
        self.gathered = np.empty((group.size, self.width * self.shard), self.flat.dtype)

    def step(self) -> None:
        """Update this rank's shards from the parameters' `.grad` (the whole averaged gradient); local, no
        communication: the other ranks' shards are updated by them and arrive with `publish()`."""
        self.rebind()
        grads, start = [p.grad for p in self.params], 0
        self.holes = self._diverted()  # (raises before `grad` changes)
        for span, buf in self.holes:
            self.layout.copy_range(grads, start, span.start, self.grad[start : span.start])
            self.layout.copy_range(grads, span.start, span.stop, buf)
            start = span.stop
        self.layout.copy_range(grads, start, self.layout.padded_numel, self.grad[start:])
        for shard, v in zip(self.shards, self.mine):
            shard.grad = self.grad[self.span(range(v, v + 1))]
        self.optim.step()
        self.tag += 1
        self.grad_tag = self.tag

    def _diverted(self) -> list[tuple[slice, np.ndarray]]:
        """Take `divert` for this step, in order; a span over the shards this rank carries is refused."""
        divert, self.divert = sorted(self.divert, key=lambda hole: hole[0].start), []
        own = self.span(self.mine)
        for span, _ in divert:
            if span.start < own.stop and own.start < span.stop:
                raise ValueError(f"a diverted gradient span {span.start}:{span.stop} overlaps the shards this rank "
                                 f"carries ({own.start}:{own.stop}): only other ranks' blocks are kept apart")
        return divert

    def whole_grad(self) -> np.ndarray:
        """`grad` with the spans the last step diverted copied back in (for a reader of every element of it)."""
        for span, buf in self.holes:
            self.grad[span] = buf
        self.holes = []
        return self.grad

    def rebind(self) -> None:
        """Re-attach parameters whose `.data` was replaced (a checkpoint loaded) to the flat buffer."""
        for p, view in zip(self.params, self.views):
            if p.data is not view:
                view[...] = p.data
                p.data = view

    def publish(self) -> None:
        """All-gather every rank's updated block into `flat` (collective)."""
        own = self.flat[self.span(self.mine)]
        self.sendbuf[: own.size] = own
        self.group.all_gather(self.sendbuf, out=self.gathered)
        for r in range(self.group.size):
            block = carried(r, self.group.size, self.virtual)
            if r != self.group.rank:
                self.flat[self.span(block)] = self.gathered[r, : len(block) * self.shard]

    def schema(self) -> Schema:
        """The names in one shard's state (the same on every rank: every shard steps together)."""
        st = self.optim.state[0]
        arrays = tuple(sorted(k for k, v in st.items() if isinstance(v, np.ndarray)))
        return arrays, tuple(sorted(k for k in st if k not in arrays))

    def rows_shape(self, count: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """Shapes of the (rows, scalars) buffers for `count` shards: rows hold the parameters then each state array;
        scalars hold the tag (the global step) then each scalar of the state, as float64."""
        arrays, scalars = self.schema()
        return (count, 1 + len(arrays), self.shard), (count, 1 + len(scalars))

    def arrays(self, v: int, scalars: np.ndarray) -> list[np.ndarray]:
        """Shard `v`'s arrays in `pack`'s row order (the live arrays, not copies); its scalars into `scalars`."""
        st = self.optim.state[v - self.mine.start]
        arrays, names = self.schema()
        scalars[0] = self.tag
        for i, key in enumerate(names, 1):
            scalars[i] = st[key]
        return [self.flat[self.span(range(v, v + 1))], *(st[key] for key in arrays)]

    def pack(self, v: int, rows: np.ndarray, scalars: np.ndarray) -> None:
        """Shard `v` (one this rank carries) into `rows` (1 + arrays, shard) and `scalars` (1 + scalars)."""
        for i, array in enumerate(self.arrays(v, scalars)):
            rows[i] = array

    def unpack(self, rows: np.ndarray, scalars: np.ndarray, like: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state in `rows`/`scalars` (copies), scalars cast like this rank's own state's."""
        arrays, names = self.schema()
        ref = like if like is not None else self.optim.state[0]
        st: dict[str, Any] = {key: rows[i].copy() for i, key in enumerate(arrays, 1)}
        for i, key in enumerate(names, 1):
            st[key] = type(ref[key])(scalars[i])
        return st

    def replay(self, rows: np.ndarray, scalars: np.ndarray, grads: Sequence[np.ndarray]) -> None:
        """Advance a packed shard by one step per gradient in `grads` (in place), as its owner would have."""
        param = Parameter(rows[0].copy())
        optim = self.optimizer_class([param], **self.defaults)
        optim.state = [self.unpack(rows, scalars)]
        for g in grads:
            param.grad = g
            optim.step()
        arrays, names = self.schema()
        rows[0] = param.data
        for i, key in enumerate(arrays, 1):
            rows[i] = optim.state[0][key]
        for i, key in enumerate(names, 1):
            scalars[i] = optim.state[0][key]
        scalars[0] += len(grads)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)
        self.state = self.optim.state


def init_state(optim: Optimizer) -> None:
    """Create each shard's state now as the first step would (AdamW: zeros and step 0), so that every copy of a shard
    has one shape from the start; other optimizers create theirs at their first step."""
    if not isinstance(optim, AdamW):
        return
    for p, st in zip(optim.params, optim.state):
        if st:
            continue
        st["step"] = 0
        st["exp_avg"] = np.zeros_like(p.data)
        st["exp_avg_sq"] = np.zeros_like(p.data)
        if optim.defaults.get("amsgrad"):
            st["max_exp_avg_sq"] = np.zeros_like(p.data)
