"""`DistributedSampler`: each rank's share of a data set's indices, reshuffled per epoch.

Padding: without `drop_last`, when `n` is not a multiple of `num_replicas`, the (shuffled) index
list is extended by repeating its own first entries until it divides evenly, so every rank gets
`ceil(n / num_replicas)` indices and a few samples are seen twice per epoch. With `drop_last`
the tail is cut instead: every rank gets `n // num_replicas` indices and the shards are disjoint.
In both cases the shards of one epoch together cover the whole (resp. the kept part of the) data set.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np
from axond.distributed import default_registry as defaults


def _default_world() -> tuple[int, int]:
    group = defaults.require("DistributedSampler (or give num_replicas and rank)")
    return group.size, group.rank


class DistributedSampler:
    """Iterates over this rank's indices into a data set of `n` items (an int or anything with len())."""

    def __init__(
        self,
        n: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        size = n if isinstance(n, int) else len(n)
        if size < 0:
            raise ValueError(f"DistributedSampler needs a data set size >= 0, got {size}")
        if num_replicas is None or rank is None:
            world, my_rank = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = my_rank if rank is None else rank
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.n = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.num_samples = size // num_replicas if drop_last else math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of `epoch` (call it at the start of every epoch, with the same value on every rank)."""
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, as an int64 array."""
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(self.n)
        else:
            order = np.arange(self.n)
        if self.total_size > self.n:
            order = np.resize(order, self.total_size)
        else:
            order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas].astype(np.int64, copy=False)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples
