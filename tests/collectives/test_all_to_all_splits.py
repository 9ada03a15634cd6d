"""all_to_all with split sizes (torch's all_to_all_single): uneven blocks against a NumPy reference.

Ranks are threads over real loopback sockets, and threads of the mock backend (and real processes for the
module-level API); split
matrices are random but seeded, with empty blocks, trailing dimensions and blocks big enough for the
sender threads. A sender and receiver that disagree on a block's size both raise, naming each other.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import axond
from axond import DistributedError, ProcessGroup
from axond.distributed.backends.splits import announcement, settle
from axond.testing import run_on, run_processes
from collective_cases import on_backend

MakeGroups = Callable[..., list[ProcessGroup]]


@pytest.fixture(params=["tcp", "mock"])
def make_groups(make_groups: MakeGroups, request: pytest.FixtureRequest) -> MakeGroups:
    """conftest's, on the tcp and on the mock backend: both keep this contract."""
    return on_backend(make_groups, request.param)


def _case(n: int, seed: int, max_rows: int, tail: tuple[int, ...], dtype: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """splits[s, d] = rows rank s sends to rank d; inputs[s] holds rows tagged by (sender, destination, row)."""
    rng = np.random.default_rng(seed)
    splits = rng.integers(0, max_rows + 1, size=(n, n))
    splits[rng.random((n, n)) < 0.25] = 0  # some empty blocks
    inputs = []
    for s in range(n):
        rows = int(splits[s].sum())
        tags = np.repeat(np.arange(n), splits[s]) * 1000 + s * 100_000
        base = (tags + np.concatenate([np.arange(k) for k in splits[s]]) if rows else tags) % 127
        x = np.broadcast_to(base.reshape(rows, *([1] * len(tail))), (rows, *tail)).astype(dtype)
        inputs.append(np.ascontiguousarray(x))
    return splits, inputs


def _expected(splits: np.ndarray, inputs: list[np.ndarray], r: int) -> np.ndarray:
    n = len(inputs)
    blocks = []
    for s in range(n):
        start = int(splits[s, :r].sum())
        blocks.append(inputs[s][start : start + int(splits[s, r])])
    return np.concatenate(blocks)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("ask_peers", [False, True], ids=["output-given", "output-asked"])
def test_uneven_blocks_match_numpy(make_groups: MakeGroups, n: int, ask_peers: bool) -> None:
    gs = make_groups(n, 10.0)
    for seed, (max_rows, tail, dtype) in enumerate([(5, (), "float32"), (3, (2, 3), "int16"),
                                                    (30_000, (2,), "float64"), (0, (4,), "uint8")]):
        splits, inputs = _case(n, seed, max_rows, tail, dtype)

        def body(pg: ProcessGroup) -> np.ndarray:
            r = pg.rank
            outs = None if ask_peers else list(splits[:, r])
            return pg.all_to_all(inputs[r], input_split_sizes=list(splits[r]), output_split_sizes=outs)

        for r, got in enumerate(run_on(gs, body)):
            want = _expected(splits, inputs, r)
            assert got.shape == want.shape and got.dtype == want.dtype, (seed, r)
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed} rank {r}")


def test_even_input_with_given_output_and_numpy_split_sizes(make_groups: MakeGroups) -> None:
    gs = make_groups(3)
    x = [np.arange(6, dtype=np.int64) + 10 * r for r in range(3)]
    got = run_on(gs, lambda pg: pg.all_to_all(x[pg.rank], output_split_sizes=np.array([2, 2, 2])))
    for r in range(3):
        np.testing.assert_array_equal(got[r], np.concatenate([x[s][2 * r : 2 * r + 2] for s in range(3)]))


def test_async_uneven_all_to_all_completes_in_issue_order(make_groups: MakeGroups) -> None:
    gs = make_groups(2)

    def body(pg: ProcessGroup) -> tuple[np.ndarray, np.ndarray]:
        x = np.arange(3 if pg.rank == 0 else 5, dtype=np.float32) + 10 * pg.rank
        splits = [1, 2] if pg.rank == 0 else [4, 1]
        w1 = pg.all_to_all(x, async_op=True, input_split_sizes=splits)
        w2 = pg.all_to_all(x[::-1], async_op=True, input_split_sizes=splits)  # not contiguous
        assert w1 is not None and w2 is not None and w2.wait(5.0) and w1.is_completed()
        return w1.result(), w2.result()

    (a0, b0), (a1, b1) = run_on(gs, body)
    np.testing.assert_array_equal(a0, [0, 10, 11, 12, 13])
    np.testing.assert_array_equal(a1, [1, 2, 14])
    np.testing.assert_array_equal(b0, [2, 14, 13, 12, 11])
    np.testing.assert_array_equal(b1, [1, 0, 10])


def test_a_block_size_disagreement_raises_on_both_sides_naming_the_split_sizes(make_groups: MakeGroups) -> None:
    gs = make_groups(2, 2.0)

    def body(pg: ProcessGroup) -> np.ndarray:
        if pg.rank == 0:  # sends 3 rows to rank 1, which expects 2
            return pg.all_to_all(np.zeros((4, 2)), input_split_sizes=[1, 3], output_split_sizes=[1, 2])
        return pg.all_to_all(np.zeros((3, 2)), input_split_sizes=[2, 1], output_split_sizes=[2, 1])

    out = run_on(gs, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert str(out[1]).startswith(
        "all_to_all on group 'world' (rank 1 of 2): peer rank 0 and this rank disagree on the split sizes of "
        "all_to_all: rank 0 sends this rank 6 elements, but this rank's output_split_sizes[0] expects 4 "
        "(elements = rows x row size)"), out[1]
    assert "all_to_all on group 'world' (rank 0 of 2): " in str(out[0])
    assert "rank 1 expects 4 elements from this rank, but this rank's input_split_sizes[1] sends 6" in str(out[0])
    assert out[0].peer == 1 and out[1].peer == 0


def test_uneven_on_one_rank_and_even_on_the_other_is_a_mismatch(make_groups: MakeGroups) -> None:
    gs = make_groups(2, 2.0)

    def body(pg: ProcessGroup) -> np.ndarray:
        x = np.zeros(4, np.float32)
        return pg.all_to_all(x, input_split_sizes=[2, 2], output_split_sizes=[2, 2]) if pg.rank else pg.all_to_all(x)

    out = run_on(gs, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert ("peer rank 0 called all_to_all (float32, 4 elements) but this rank called all_to_all with split sizes "
            "(float32)") in str(out[1])


@pytest.mark.parametrize("ins, outs, error, match", [
    ([1, 1], None, ValueError, r"input_split_sizes must hold 3 non-negative row counts \(one per rank\), got \[1, 1\]"),
    ([1, -1, 3], None, ValueError, "non-negative"),
    ([1, 1, 1], None, ValueError, r"input_split_sizes \[1, 1, 1\] add up to 3 rows, but x has 4"),
    ([1.5, 1, 1.5], None, TypeError, "sequence of 3 non-negative ints"),
    ([2, 1, 1], [1, 2, 2], ValueError, r"input_split_sizes\[0\] = 2 rows to itself, but output_split_sizes\[0\] = 1"),
    (None, [1, 1, 1], ValueError, "divisible by the group size 3 when input_split_sizes is not given"),
])
def test_bad_split_sizes_are_refused_before_anything_is_sent(make_groups: MakeGroups, ins: list | None,
                                                             outs: list | None, error: type, match: str) -> None:
    gs = make_groups(3)
    out = run_on(gs, lambda pg: pg.all_to_all(np.zeros(4), input_split_sizes=ins, output_split_sizes=outs),
                 return_exceptions=True)
    for e in out:
        assert isinstance(e, error) and e.args, out
    with pytest.raises(error, match=match):
        raise out[0]
    # nothing was sent and no sequence number was used: the group still works
    got = run_on(gs, lambda pg: pg.all_to_all(np.full(3, pg.rank), input_split_sizes=[1, 1, 1]))
    np.testing.assert_array_equal(got[2], [0, 1, 2])


def _dispatch_tokens() -> list[int]:
    """A mixture-of-experts dispatch: each rank routes its tokens to the rank holding their expert."""
    r, n = axond.get_rank(), axond.get_world_size()
    rng = np.random.default_rng(r)
    expert = rng.integers(0, n, size=50 + 17 * r)
    order = np.argsort(expert, kind="stable")
    tokens = np.stack([np.full(len(expert), r), order], axis=1)[order]  # (sender, original index)
    counts = np.bincount(expert, minlength=n)
    got = axond.all_to_all(tokens, input_split_sizes=counts)
    back = axond.all_to_all(got, input_split_sizes=np.bincount(got[:, 0], minlength=n), output_split_sizes=counts)
    assert np.array_equal(back, tokens)  # the reverse dispatch returns every token to its sender, in order
    return [int(v) for v in np.sort(got[:, 0])]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(60)
def test_module_api_dispatch_and_return_across_processes() -> None:
    out = run_processes(_dispatch_tokens, 3, timeout=40.0)
    for r, senders in enumerate(out):
        expected = sorted(s for s in range(3) for e in np.random.default_rng(s).integers(0, 3, size=50 + 17 * s)
                          if e == r)
        assert senders == expected


def _announce_and_settle(g: ProcessGroup, ins: list[int], outs: list[int] | None, row: int) -> tuple[list[int], list]:
    """The nccl backend's count exchange (splits.announcement / settle), run here over real tcp ranks."""
    return settle(g.rank, ins, outs, row, g.all_to_all(announcement(ins, outs, row)))


def test_the_count_exchange_of_the_nccl_backend_finds_outputs_and_disagreements(make_groups: MakeGroups) -> None:
    gs = make_groups(3)
    splits = [[1, 2, 0], [0, 0, 4], [3, 1, 1]]  # splits[s][d]: rows s sends to d
    given = run_on(gs, lambda g: _announce_and_settle(g, splits[g.rank], [splits[s][g.rank] for s in range(3)], 2))
    asked = run_on(gs, lambda g: _announce_and_settle(g, splits[g.rank], None, 2))
    for r in range(3):
        assert given[r] == asked[r] == ([splits[s][r] for s in range(3)], [])

    # rank 0 sends 2 rows to rank 1, which expects 1 row from it
    outs = [[1, 0, 3], [1, 0, 1], [0, 4, 1]]
    got = run_on(gs, lambda g: _announce_and_settle(g, splits[g.rank], outs[g.rank], 2))
    assert got[2][1] == []
    assert got[1][1] == [(0, "peer rank 0 and this rank disagree on the split sizes of all_to_all: rank 0 sends "
                             "this rank 4 elements, but this rank's output_split_sizes[0] expects 2 "
                             "(elements = rows x row size)")]
    assert got[0][1] == [(1, "peer rank 1 and this rank disagree on the split sizes of all_to_all: rank 1 expects "
                             "2 elements from this rank, but this rank's input_split_sizes[1] sends 4 "
                             "(elements = rows x row size)")]

    # rows of 3 elements on rank 2, of 2 elsewhere: 3 rows of 3 are not whole rows of 2
    rows = [2, 2, 3]
    got = run_on(gs, lambda g: _announce_and_settle(g, splits[g.rank], None, rows[g.rank]))
    assert got[0][1] == [(2, "peer rank 2 sends this rank 9 elements, not a whole number of this rank's rows (2 elements "
                             "each): the ranks' arrays differ in shape beyond the first dimension")]
