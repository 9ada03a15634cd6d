"""Pure arithmetic of the algorithms: how arrays split into blocks and pipeline chunks.

Kept free of sockets so that property tests can check it exhaustively: every rank must compute
the same schedule from the same (count, size) without talking to the others.
"""

from __future__ import annotations

def split_even(count: int, parts: int) -> list[tuple[int, int]]:
    """Split range(count) into `parts` contiguous (start, stop) blocks whose sizes differ by at most one."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_count(max_block_bytes: int, chunk_bytes: int) -> int:
    """Number of pipeline chunks each block is cut into (at least one)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, -(-max_block_bytes // chunk_bytes))


def pipeline_chunk_bytes(block_bytes: int, target: int, least: int, most: int) -> int:
    """Chunk size for pipelining a block: `target` if set, else about a quarter of the block, clamped to
    [least, most] (the tcp backend's bounds: `policy.PIPELINE_CHUNK_BYTES`)."""
    if target > 0:
        return target
    return min(most, max(least, block_bytes // 4))


def block_chunks(count: int, size: int, itemsize: int, chunk_bytes: int) -> list[list[tuple[int, int]]]:
    """For each of `size` blocks of range(count), its pipeline chunks as absolute (start, stop) element ranges.

    Every block gets the same number of chunks so that ranks stay in lock-step.
    """
    blocks = split_even(count, size)
    largest = max(stop - start for start, stop in blocks) * itemsize
    n = chunk_count(largest, chunk_bytes)
    out = []
    for start, stop in blocks:
        out.append([(start + a, start + b) for a, b in split_even(stop - start, n)])
    return out


def ring_reduce_scatter_blocks(rank: int, size: int, step: int) -> tuple[int, int]:
    """(block sent, block received) by `rank` at reduce-scatter `step`; after size-1 steps rank owns block `rank`."""
    return (rank - step - 1) % size, (rank - step - 2) % size


def ring_all_gather_blocks(rank: int, size: int, step: int) -> tuple[int, int]:
    """(block sent, block received) by `rank` at all-gather `step`, starting from owning block `rank`."""
    return (rank - step) % size, (rank - step - 1) % size


def largest_power_of_two(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def binomial_children(vrank: int, size: int) -> list[int]:
    """Virtual ranks that `vrank` sends to in a binomial-tree broadcast rooted at virtual rank 0, in order."""
    children = []
    mask = 1
    while mask < size:
        if vrank < mask and vrank + mask < size:
            children.append(vrank + mask)
        mask <<= 1
    return children


def binomial_parent(vrank: int) -> int | None:
    """Virtual rank `vrank` receives from in a binomial-tree broadcast (None for the root)."""
    if vrank == 0:
        return None
    return vrank - largest_power_of_two(vrank)
