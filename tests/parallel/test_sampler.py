"""DistributedSampler: shards are disjoint, cover the data set each epoch, and pad as documented."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axond.parallel import DistributedSampler


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 500),
    replicas=st.integers(1, 17),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
)
def test_coverage_and_disjointness(n: int, replicas: int, drop_last: bool, shuffle: bool, seed: int, epoch: int) -> None:
    parts = []
    for r in range(replicas):
        s = DistributedSampler(n, replicas, r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        parts.append(s.indices())
        assert len(s) == len(parts[-1])
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1, "every rank gets the same number of samples"
    per_rank = lengths.pop()
    everything = np.concatenate(parts)
    assert everything.min(initial=0) >= 0 and everything.max(initial=0) < max(n, 1)
    if drop_last:
        assert per_rank == n // replicas
        assert len(np.unique(everything)) == len(everything), "drop_last shards are disjoint"
    else:
        assert per_rank == math.ceil(n / replicas)
        assert set(everything.tolist()) == set(range(n)), "the shards cover the data set"
        padding = per_rank * replicas - n
        assert len(everything) - len(np.unique(everything)) == padding, "only the padding repeats samples"
    for p in parts:
        assert len(np.unique(p)) == len(p), "padding never gives one rank the same sample twice"


def test_epochs_reshuffle_deterministically() -> None:
    a = DistributedSampler(100, 4, 1, seed=3)
    b = DistributedSampler(100, 4, 1, seed=3)
    first = a.indices()
    np.testing.assert_array_equal(first, b.indices())
    a.set_epoch(1)
    assert not np.array_equal(first, a.indices())
    b.set_epoch(1)
    np.testing.assert_array_equal(a.indices(), b.indices())
    assert not np.array_equal(first, DistributedSampler(100, 4, 1, seed=4).indices())


def test_no_shuffle_is_strided_and_padding_repeats_the_head() -> None:
    assert [list(DistributedSampler(10, 4, r, shuffle=False)) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [list(DistributedSampler(10, 4, r, shuffle=False, drop_last=True)) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_accepts_sized_and_rejects_bad_arguments() -> None:
    assert len(DistributedSampler(list(range(9)), 2, 0)) == 5
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        DistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(10, 0, 0)
