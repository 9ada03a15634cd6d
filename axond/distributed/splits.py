"""Split sizes of an uneven `all_to_all` (torch's `all_to_all_single`): checked once, for every backend.

Rows are counted along the first dimension. `input_split_sizes[i]` rows of `x` go to group rank i, in
order; `output_split_sizes[j]` rows arrive from group rank j. Without input sizes, `x` splits evenly;
without output sizes, the backend asks the peers first (one small all_to_all of the counts), which
is what a mixture-of-experts dispatch would otherwise do by hand.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import accumulate


def check_splits(shape: tuple[int, ...], size: int, rank: int, input_split_sizes: Sequence[int] | None,
                 output_split_sizes: Sequence[int] | None) -> tuple[list[int], list[int] | None]:
    """(input sizes, output sizes or None: ask the peers), validated against `x.shape` and the group size."""
    if len(shape) == 0:
        raise ValueError("all_to_all needs an array with a first dimension to split, got a 0-d array")
    if input_split_sizes is None:
        if shape[0] % size:
            raise ValueError(f"all_to_all needs x.shape[0] divisible by the group size {size} when "
                             f"input_split_sizes is not given; got shape {shape}")
        ins = [shape[0] // size] * size
    else:
        ins = _sizes("input_split_sizes", input_split_sizes, size)
        if sum(ins) != shape[0]:
            raise ValueError(f"all_to_all input_split_sizes {ins} add up to {sum(ins)} rows, but x has "
                             f"{shape[0]} (shape {shape})")
    if output_split_sizes is None:
        return ins, None
    outs = _sizes("output_split_sizes", output_split_sizes, size)
    if outs[rank] != ins[rank]:
        raise ValueError(f"all_to_all on rank {rank}: input_split_sizes[{rank}] = {ins[rank]} rows to itself, but "
                         f"output_split_sizes[{rank}] = {outs[rank]} rows from itself; they must be equal")
    return ins, outs


def _sizes(name: str, sizes: Sequence[int], size: int) -> list[int]:
    try:
        out = [operator.index(v) for v in sizes]
    except TypeError:
        raise TypeError(f"all_to_all {name} must be a sequence of {size} non-negative ints (one per rank), "
                        f"got {sizes!r}") from None
    if len(out) != size or any(v < 0 for v in out):
        raise ValueError(f"all_to_all {name} must hold {size} non-negative row counts (one per rank), got {out}")
    return out


def offsets(sizes: list[int]) -> list[int]:
    """Start row of each block, plus the total: [0, s0, s0 + s1, ...]."""
    return [0, *accumulate(sizes)]
