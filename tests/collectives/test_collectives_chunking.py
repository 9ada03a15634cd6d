"""Property tests of the schedule arithmetic every rank computes independently."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from axond.distributed.backends import chunking
from axond.distributed.backends.tcp.policy import PIPELINE_CHUNK_BYTES


@given(st.integers(0, 10**7), st.integers(1, 64))
def test_split_even_covers_range_in_order_with_sizes_within_one(count: int, parts: int) -> None:
    blocks = chunking.split_even(count, parts)
    assert len(blocks) == parts
    assert blocks[0][0] == 0 and blocks[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    sizes = [e - s for s, e in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@settings(deadline=None, max_examples=200)
@given(st.integers(0, 200_000), st.integers(1, 16), st.sampled_from([1, 2, 4, 8]), st.integers(256, 1 << 21))
def test_block_chunks_partition_each_block_with_equal_chunk_counts(count: int, size: int, itemsize: int,
                                                                   chunk_bytes: int) -> None:
    chunks = chunking.block_chunks(count, size, itemsize, chunk_bytes)
    assert len(chunks) == size
    assert len({len(c) for c in chunks}) == 1
    flat = [c for block in chunks for c in block]
    assert flat[0][0] == 0 and flat[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    biggest = max(e - s for s, e in flat)
    assert biggest * itemsize <= chunk_bytes + itemsize


@given(st.integers(1, 64))
def test_ring_schedules_end_with_each_rank_owning_its_block(size: int) -> None:
    for rank in range(size):
        owned = rank
        for step in range(size - 1):
            sent, received = chunking.ring_reduce_scatter_blocks(rank, size, step)
            left_sent, _ = chunking.ring_reduce_scatter_blocks((rank - 1) % size, size, step)
            assert received == left_sent
            if step > 0:
                assert sent == chunking.ring_reduce_scatter_blocks(rank, size, step - 1)[1]
            owned = received
        assert owned == rank
        have = {rank}
        for step in range(size - 1):
            sent, received = chunking.ring_all_gather_blocks(rank, size, step)
            assert sent in have
            assert received == chunking.ring_all_gather_blocks((rank - 1) % size, size, step)[0]
            have.add(received)
        assert have == set(range(size))


@given(st.integers(1, 200))
def test_binomial_tree_reaches_everyone_once(size: int) -> None:
    parents = {v: chunking.binomial_parent(v) for v in range(size)}
    children = {v: chunking.binomial_children(v, size) for v in range(size)}
    assert parents[0] is None
    for v in range(1, size):
        p = parents[v]
        assert p is not None and p < v and v in children[p]
    assert sorted(c for cs in children.values() for c in cs) == list(range(1, size))


@given(st.integers(1, 1 << 40))
def test_largest_power_of_two(n: int) -> None:
    p = chunking.largest_power_of_two(n)
    assert p <= n < 2 * p and p & (p - 1) == 0


@given(st.integers(0, 1 << 32))
def test_pipeline_chunk_is_clamped(block: int) -> None:
    least, most = PIPELINE_CHUNK_BYTES
    c = chunking.pipeline_chunk_bytes(block, 0, least, most)
    assert least <= c <= most
