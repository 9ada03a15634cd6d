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

import numpy as np


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


ASKING = -1
"""What a rank announces as the count it expects back when it passed no output sizes (it takes what comes)."""


def disagreement(peer: int, sends_here: int, expected_here: int, expects_back: int, sends_back: int) -> str | None:
    """Why the blocks between this rank and `peer` do not match (element counts both ways), or None.

    `sends_here`/`expects_back`: what `peer` announced it sends this rank and expects from it (ASKING: anything);
    `expected_here`/`sends_back`: this rank's output_split_sizes[peer] and input_split_sizes[peer], in elements.
    """
    parts = []
    if sends_here != expected_here:
        parts.append(f"rank {peer} sends this rank {sends_here} elements, but this rank's output_split_sizes[{peer}] "
                     f"expects {expected_here}")
    if expects_back not in (ASKING, sends_back):
        parts.append(f"rank {peer} expects {expects_back} elements from this rank, but this rank's "
                     f"input_split_sizes[{peer}] sends {sends_back}")
    if not parts:
        return None
    return (f"peer rank {peer} and this rank disagree on the split sizes of all_to_all: " + "; ".join(parts)
            + " (elements = rows x row size)")


def announcement(ins: list[int], outs: list[int] | None, row: int) -> np.ndarray:
    """Row d: (elements this rank sends rank d, elements it expects from rank d or ASKING), for an all_to_all of counts."""
    back = [v * row for v in outs] if outs is not None else [ASKING] * len(ins)
    return np.array([[v * row for v in ins], back], np.int64).T.copy()


def settle(rank: int, ins: list[int], outs: list[int] | None, row: int,
           heard: np.ndarray) -> tuple[list[int], list[tuple[int, str]]]:
    """From `heard` (row p: what rank p announced to this rank), the output sizes in rows and the disagreements.

    Without output sizes of its own, this rank takes the announced ones (which must be whole rows).
    """
    got = [int(v) for v in heard[:, 0]]
    problems = []
    if outs is None:
        outs = [v // row if row else 0 for v in got]
        expected = [v if row == 0 or v % row == 0 else -1 for v in got]
    else:
        expected = [v * row for v in outs]
    for p in range(len(ins)):
        if p == rank:
            continue
        if expected[p] < 0:
            problems.append((p, f"peer rank {p} sends this rank {got[p]} elements, not a whole number of this rank's rows "
                                f"({row} elements each): the ranks' arrays differ in shape beyond the first dimension"))
            continue
        why = disagreement(p, got[p], expected[p], int(heard[p, 1]), ins[p] * row)
        if why is not None:
            problems.append((p, why))
    return outs, problems
