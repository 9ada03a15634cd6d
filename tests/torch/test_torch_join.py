"""`axond.torch.join.broadcast_state`: the state a joining rank of a torch live job takes from a live peer, over real
loopback TCP groups (three ranks: the source, a receiver with its own tensors to fill in place, a receiver with none).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from axond.distributed.process_group import ProcessGroup  # noqa: E402
from axond.errors import DistributedError  # noqa: E402
from axond.testing import run_threads  # noqa: E402
from axond.torch.join import broadcast_state  # noqa: E402


def sample() -> dict[str, Any]:
    """A model's and an AdamW's state dict shapes: int keys, tuples, 0-d step tensors, bfloat16, a large tensor (sent
    from its own memory), a non-contiguous one, an empty one, scalars."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(600, 600, generator=g)  # 1.4 MB: broadcast on its own
    model = {"w": big, "b": torch.randn(600, generator=g), "half": torch.randn(5, generator=g).bfloat16(),
             "count": torch.tensor(3, dtype=torch.int64), "mask": torch.tensor([True, False])}
    return {"step": 17, "model": model,
            "optimizer": {"state": {0: {"step": torch.tensor(17.0), "exp_avg": torch.randn(600, 600, generator=g).t()},
                                    1: {"step": torch.tensor(17.0), "exp_avg": torch.zeros(0)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None,
                                            "maximize": False, "params": [0, 1]}]}}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def test_the_state_arrives_whole_and_fills_the_receivers_own_tensors_in_place() -> None:
    def rank(group: ProcessGroup) -> tuple[Any, int, bool]:
        if group.rank == 0:
            state, nbytes = broadcast_state(group, 0, sample(), None)
            return state, nbytes, True
        into = {"model": {"w": torch.zeros(600, 600), "b": torch.zeros(3)}} if group.rank == 1 else None
        own = into["model"]["w"] if into is not None else None
        state, nbytes = broadcast_state(group, 0, None, into)
        return state, nbytes, own is None or state["model"]["w"].data_ptr() == own.data_ptr()  # filled in place

    results = run_threads(rank, 3, timeout=60.0)
    want = sample()
    for state, nbytes, in_place in results:
        assert same(state, want) and in_place
        assert nbytes == 600 * 600 * 4 * 2 + 600 * 4 + 5 * 2 + 8 + 2 + 4 * 2


def test_a_state_that_is_neither_tensor_container_nor_scalar_is_refused_on_the_source() -> None:
    def rank(group: ProcessGroup) -> None:  # the source raises; its aborted group makes the receiver raise too
        broadcast_state(group, 0, {"model": {"f": object()}} if group.rank == 0 else None, None)

    with pytest.raises(Exception, match="'/model/f' is a object, neither a tensor") as raised:
        run_threads(rank, 2, timeout=20.0)
    assert isinstance(raised.value.__cause__, DistributedError), raised.value
