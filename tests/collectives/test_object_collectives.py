"""The torch-style object collectives (`axond.distributed.forms.objects`) on real ranks over loopback.

Ranks are threads of this process (one group per world size, reused across tests; over loopback sockets and
on the mock backend), plus one run in
real processes for the default group (`group=None`). Every rank sends objects of a different size:
empty bytes, None, a dict holding a NumPy array, and a ~1 MB object on one rank only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import axond
from axond import DistributedError, ProcessGroup
from axond.testing import run_on, run_processes
from collective_cases import group_members, on_backend

pytestmark = pytest.mark.timeout(60)

BIG = b"\x07" * 1_000_000
MakeGroups = Callable[..., list[ProcessGroup]]


@pytest.fixture(params=["tcp", "mock"])
def make_groups(make_groups: MakeGroups, request: pytest.FixtureRequest) -> MakeGroups:
    """conftest's, on the tcp and on the mock backend: both keep this contract."""
    return on_backend(make_groups, request.param)


@pytest.fixture(scope="module", params=[(n, t) for t in ("auto", "mock") for n in (1, 2, 3, 4)],
                ids=[f"{n}-{t}" for t in ("auto", "mock") for n in (1, 2, 3, 4)])
def groups(request: pytest.FixtureRequest) -> Iterator[list[ProcessGroup]]:
    """As conftest's, and the same sizes on the mock backend."""
    yield from group_members(*request.param)


def obj(rank: int) -> Any:
    """Rank `rank`'s object: a different size and kind on each rank."""
    return [b"", {"rank": rank, "w": np.arange(rank + 3, dtype=np.float32), "name": "x" * rank}, None, BIG,
            ("tuple", rank)][rank % 5]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and bool(a == b)


def _raise(message: str) -> None:
    raise RuntimeError(message)


class LoadsBadly:
    """Pickles fine, fails to unpickle (as a class missing on the receiving side would)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _raise, ("no such class here",)


def test_all_gather_object(groups: list[ProcessGroup]) -> None:
    n = len(groups)

    def body(g: ProcessGroup) -> list[Any]:
        out: list[Any] = [None] * n
        axond.all_gather_object(out, obj(g.rank), group=g)
        return out

    for r, got in enumerate(run_on(groups, body)):
        assert len(got) == n and all(same(got[q], obj(q)) for q in range(n)), f"rank {r}"


@pytest.mark.parametrize("src_from_end", [False, True])
def test_broadcast_object_list(groups: list[ProcessGroup], src_from_end: bool) -> None:
    n = len(groups)
    src = n - 1 if src_from_end else 0
    sent = [b"", {"lr": 0.1, "w": np.ones((2, 3))}, None, BIG, 42]

    def body(g: ProcessGroup) -> list[Any]:
        mine = list(sent) if g.rank == src else ["stale"] * len(sent)
        axond.broadcast_object_list(mine, src=src, group=g)
        return mine

    for r, got in enumerate(run_on(groups, body)):
        assert len(got) == len(sent) and all(same(a, b) for a, b in zip(got, sent)), f"rank {r}"


def test_gather_object_to_the_last_rank(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    dst = n - 1

    def body(g: ProcessGroup) -> list[Any] | None:
        out: list[Any] | None = [None] * n if g.rank == dst else None
        axond.gather_object(obj(g.rank), out, dst=dst, group=g)
        return out

    got = run_on(groups, body)
    assert got[:dst] == [None] * dst
    assert all(same(got[dst][q], obj(q)) for q in range(n))


def test_scatter_object_list_from_the_last_rank(groups: list[ProcessGroup]) -> None:
    n = len(groups)
    src = n - 1

    def body(g: ProcessGroup) -> Any:
        out: list[Any] = [None]
        axond.scatter_object_list(out, [obj(q) for q in range(n)] if g.rank == src else None, src=src, group=g)
        return out[0]

    for r, got in enumerate(run_on(groups, body)):
        assert same(got, obj(r)), f"rank {r}"


def test_subgroup_takes_global_ranks(make_groups: Any) -> None:
    quad = make_groups(4, 10.0)

    def body(g: ProcessGroup) -> dict[str, Any] | None:
        sub = g.new_group([1, 3])
        try:
            if not sub.contains(g.global_rank):
                return None
            me = g.global_rank
            gathered: list[Any] = [None, None]
            axond.all_gather_object(gathered, obj(me), group=sub)
            bcast: list[Any] = [None, None] if me == 1 else [{"from": 3}, BIG]
            axond.broadcast_object_list(bcast, src=3, group=sub)
            at_dst: list[Any] | None = [None, None] if me == 3 else None
            axond.gather_object(("g", me), at_dst, dst=3, group=sub)
            scattered: list[Any] = [None]
            axond.scatter_object_list(scattered, [b"", "to 3"] if me == 3 else None, src=3, group=sub)
            return {"gathered": gathered, "bcast": bcast, "at_dst": at_dst, "scattered": scattered[0]}
        finally:
            sub.destroy()

    out = run_on(quad, body)
    assert out[0] is None and out[2] is None
    for me in (1, 3):
        assert all(same(a, b) for a, b in zip(out[me]["gathered"], [obj(1), obj(3)]))
        assert out[me]["bcast"][0] == {"from": 3} and out[me]["bcast"][1] == BIG
    assert out[1]["at_dst"] is None and out[3]["at_dst"] == [("g", 1), ("g", 3)]
    assert out[1]["scattered"] == b"" and out[3]["scattered"] == "to 3"


def _default_group_ops() -> list[Any]:
    r, n = axond.get_rank(), axond.get_world_size()
    gathered: list[Any] = [None] * n
    axond.all_gather_object(gathered, {"rank": r})
    bcast: list[Any] = [f"config of {r}", None]
    axond.broadcast_object_list(bcast, src=1)
    at_dst: list[Any] | None = [None] * n if r == 2 else None
    axond.gather_object(r * r, at_dst, dst=2)
    scattered: list[Any] = [None]
    axond.scatter_object_list(scattered, [f"shard {q}" for q in range(n)] if r == 1 else None, src=1)
    return [gathered, bcast, at_dst, scattered[0]]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_default_group_in_processes() -> None:
    out = run_processes(_default_group_ops, 3, timeout=40.0)
    for r, (gathered, bcast, at_dst, scattered) in enumerate(out):
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert bcast == ["config of 1", None]
        assert at_dst == ([0, 1, 4] if r == 2 else None)
        assert scattered == f"shard {r}"


def _still_in_step(pair: list[ProcessGroup]) -> None:
    """The group is usable (no stray frame was sent): an all_gather_object on both ranks works."""
    def body(g: ProcessGroup) -> list[Any]:
        out: list[Any] = [None, None]
        axond.all_gather_object(out, g.rank, group=g)
        return out

    assert run_on(pair, body) == [[0, 1], [0, 1]]


def test_bad_arguments_raise_on_the_calling_rank_before_any_communication(make_groups: Any) -> None:
    pair = make_groups(2, 5.0)
    g = pair[0]  # alone: any communication would block until the 5 s timeout
    with pytest.raises(ValueError, match=r"object_list has 3 elements but must have 2 .*\[None\] \* 2"):
        axond.all_gather_object([None] * 3, "x", group=g)
    with pytest.raises(TypeError, match="object_list must be a list of 2 elements, got tuple"):
        axond.all_gather_object((None, None), "x", group=g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on the dst rank: object_gather_list is None; pass a list of 2"):
        axond.gather_object("x", None, dst=0, group=g)
    with pytest.raises(ValueError, match="object_gather_list has 1 elements but must have 2"):
        axond.gather_object("x", [None], dst=0, group=g)
    with pytest.raises(ValueError, match="on the src rank: scatter_object_input_list has 3 elements but must have 2"):
        axond.scatter_object_list([None], [1, 2, 3], src=0, group=g)
    with pytest.raises(ValueError, match="on the src rank: scatter_object_input_list is None"):
        axond.scatter_object_list([None], None, src=0, group=g)
    with pytest.raises(ValueError, match=r"scatter_object_output_list is empty; pass \[None\]"):
        axond.scatter_object_list([], None, src=1, group=g)
    with pytest.raises(TypeError, match="object_list must be a list"):
        axond.broadcast_object_list("abc", src=1, group=g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"global rank 5 is not in group 'world' \(ranks \[0, 1\]\)"):
        axond.broadcast_object_list([None], src=5, group=g)
    _still_in_step(pair)


@pytest.mark.parametrize("bad", [lambda: 0, threading.Lock()], ids=["lambda", "lock"])
def test_an_unpicklable_object_names_its_rank_and_leaves_the_group_usable(make_groups: Any, bad: Any) -> None:
    trio = make_groups(3, 5.0)

    def body(g: ProcessGroup) -> None:
        axond.all_gather_object([None] * 3, bad if g.rank == 1 else g.rank, group=g)

    out = run_on(trio, body, return_exceptions=True)
    assert isinstance(out[1], TypeError) and isinstance(out[1].__cause__, Exception)
    assert "all_gather_object on group 'world' (rank 1 of 3): the object of global rank(s) [1] could not be " \
           "pickled" in str(out[1]) and "picklable Python objects only" in str(out[1])
    for r in (0, 2):
        assert isinstance(out[r], DistributedError), out[r]
        assert "the object of global rank(s) [1] could not be pickled, so nothing was exchanged" in str(out[r])

    def every_op(g: ProcessGroup) -> None:
        if g.rank == 2:
            with pytest.raises(TypeError, match=r"object_list\[1\] of global rank 2 \(src\) could not be pickled"):
                axond.broadcast_object_list([1, bad], src=2, group=g)
        else:
            with pytest.raises(DistributedError, match=r"object_list\[1\] of global rank 2 \(src\) could not be"):
                axond.broadcast_object_list([None, None], src=2, group=g)
        with pytest.raises(TypeError if g.rank == 0 else DistributedError, match=r"global rank 0 \(src\) could not"):
            axond.scatter_object_list([None], [bad, 1, 2] if g.rank == 0 else None, src=0, group=g)
        with pytest.raises(TypeError if g.rank == 2 else DistributedError, match=r"global rank\(s\) \[2\] could not"):
            axond.gather_object(bad if g.rank == 2 else 0, [None] * 3 if g.rank == 0 else None, dst=0, group=g)
        got: list[Any] = [None] * 3
        axond.all_gather_object(got, g.rank, group=g)  # still in step
        assert got == [0, 1, 2]

    run_on(trio, every_op)


def test_an_object_that_fails_to_unpickle_names_the_sender(make_groups: Any) -> None:
    pair = make_groups(2, 5.0)

    def body(g: ProcessGroup) -> None:
        axond.gather_object(LoadsBadly() if g.rank == 1 else 0, [None, None] if g.rank == 0 else None, dst=0, group=g)

    out = run_on(pair, body, return_exceptions=True)
    assert out[1] is None
    assert isinstance(out[0], DistributedError) and out[0].peer == 1
    assert "could not unpickle the object of global rank 1 (RuntimeError: no such class here)" in str(out[0])


def test_lists_of_different_lengths_in_broadcast_are_detected(make_groups: Any) -> None:
    pair = make_groups(2, 5.0)

    def body(g: ProcessGroup) -> None:
        axond.broadcast_object_list([1, 2] if g.rank == 0 else [None] * 3, src=0, group=g)

    out = run_on(pair, body, return_exceptions=True)
    assert isinstance(out[1], DistributedError) and "3 elements" in str(out[1]), out[1]
