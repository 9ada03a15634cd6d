"""The host bound printed by bench/collectives.py (bench/bounds.py): its arithmetic, case by case."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import bounds  # noqa: E402

MiB = 1 << 20
FREE_ADDS = 1e9  # GB/s: reductions that cost nothing


def test_two_ranks_on_two_cores_all_reduce_is_the_raw_limit() -> None:
    # The issue's own statement: at n = 2 the all_reduce busbw cannot exceed the raw duplex limit.
    assert bounds.host_bound("all_reduce", 2, 64 * MiB, 2.0, FREE_ADDS, 2) == pytest.approx(2.0, rel=1e-6)


def test_four_ranks_on_two_cores_halve_all_reduce_all_gather_and_reduce_scatter() -> None:
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert bounds.host_bound(op, 4, 16 * MiB, 2.0, FREE_ADDS, 2) == pytest.approx(1.0, rel=1e-6), op


def test_broadcast_uses_both_cores_for_one_direction() -> None:
    # n = 2: one stream, sender and receiver copy on their own cores -> 2 x raw; n = 4: 3 links share 2 cores.
    assert bounds.host_bound("broadcast", 2, 4 * MiB, 2.0, None, 2) == pytest.approx(4.0)
    assert bounds.host_bound("broadcast", 4, 4 * MiB, 2.0, None, 2) == pytest.approx(4.0 / 3)


def test_the_adds_lower_the_bound_of_reducing_ops_only() -> None:
    # n = 2 all_reduce moves 2N and adds N: at an add rate equal to raw, cpu = 3N / raw over 2 cores.
    assert bounds.host_bound("all_reduce", 2, 8 * MiB, 2.0, 2.0, 2) == pytest.approx(2.0 / 1.5)
    assert bounds.host_bound("all_gather", 2, 8 * MiB, 2.0, 0.001, 2) == bounds.host_bound(
        "all_gather", 2, 8 * MiB, 2.0, None, 2)
    assert bounds.host_bound("reduce_scatter", 2, 8 * MiB, 2.0, None, 2) is None  # unknown add rate: no bound


def test_no_bound_when_cores_outnumber_ranks_or_nothing_moves() -> None:
    assert bounds.host_bound("all_reduce", 2, MiB, 2.0, FREE_ADDS, 8) is None
    assert bounds.host_bound("all_reduce", 1, MiB, 2.0, FREE_ADDS, 1) is None
    assert bounds.host_bound("all_reduce", 2, MiB, 0.0, FREE_ADDS, 2) is None
    with pytest.raises(ValueError, match="no bound"):
        bounds.traffic("gather", 2, MiB)


def test_traffic_matches_the_bus_factor() -> None:
    # busbw x n is what each rank moves per second in nccl-tests' model; T is all ranks' bytes together.
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (2, 3, 4, 8):
            t_bytes, _ = bounds.traffic(op, n, 1000)
            assert t_bytes == pytest.approx(n * 1000 * bounds.bus_factor(op, n)), (op, n)


def test_add_rate_is_measured() -> None:
    rate = bounds.add_rate(4 * MiB, repeat=2)
    assert math.isfinite(rate) and rate > 0.05  # GB/s; any machine adds float32 faster than 50 MB/s
