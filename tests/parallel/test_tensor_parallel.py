"""Tensor parallelism over the real TCP backend, ranks as threads: column/row-parallel linears,
the four communication regions, the parallel MLP / attention / transformer block, and TP inside
a (dp x tp) DeviceMesh with DDP across dp. Everything is compared with the single-process
`axond.nn` model built from the same seed: outputs, input gradients, each rank's slice of the
parameter gradients, and parameters after several optimizer steps.

Parity tolerance: float64 throughout. Tensor parallelism only changes the order of sums (a row
layer's output is a sum of per-rank partial products, an input gradient a sum of per-rank
terms), so single results differ from the reference by a few ulps (~1e-16 relative) and a few
SGD steps keep parameters within ~1e-14. We assert 1e-10: any missing reduce, wrong slice or
doubled bias is off by more than 1e-3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.nn.optim import SGD
from axond.parallel import DDP, FSDP, DeviceMesh
from axond.parallel.tensor import (
    ColumnParallelLinear,
    CopyToParallelRegion,
    GatherFromParallelRegion,
    ParallelCausalSelfAttention,
    ParallelMLP,
    ParallelTransformerBlock,
    ReduceFromParallelRegion,
    RowParallelLinear,
    ScatterToParallelRegion,
)
from axond.testing import run_threads

TOL = 1e-10
F = np.float64
STEPS = 4


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    """fn(group) on `world` threads over real TCP sockets, with short op timeouts; results by rank."""
    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


def close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def block_of(full: Any, like: tuple[int, ...], rank: int) -> Any:
    """Rank `rank`'s contiguous block of `full` along the one axis where its shape differs from `like`."""
    if full.shape == like:
        return full
    (axis,) = [a for a, (f, s) in enumerate(zip(full.shape, like)) if f != s]
    width = like[axis]
    return np.take(full, np.arange(rank * width, (rank + 1) * width), axis=axis)


def data(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_linear(world: int, gather_output: bool) -> None:
    ref = nn.Linear(6, 8, dtype=F, rng=np.random.default_rng(7))
    assert ref.bias is not None
    x, g = data((3, 5, 6), 1), data((3, 5, 8), 2)
    y_ref = ref(x)
    dx_ref = ref.backward(g)

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        layer = ColumnParallelLinear(6, 8, group=group, gather_output=gather_output, dtype=F,
                                     rng=np.random.default_rng(7))
        y = layer(x)
        grad = g if gather_output else block_of(g, y.shape, group.rank)
        dx = layer.backward(grad)
        return y, dx, layer.weight.grad, layer.bias.grad if layer.bias is not None else None

    for rank, (y, dx, dw, db) in enumerate(run_ranks(world, body)):
        close(y, y_ref if gather_output else block_of(y_ref, (3, 5, 8 // world), rank))
        close(dx, dx_ref)
        close(dw, block_of(ref.weight.grad, (8 // world, 6), rank))
        close(db, block_of(ref.bias.grad, (8 // world,), rank))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_linear(world: int, input_is_parallel: bool) -> None:
    ref = nn.Linear(8, 6, dtype=F, rng=np.random.default_rng(8))
    assert ref.bias is not None
    x, g = data((3, 5, 8), 3), data((3, 5, 6), 4)
    y_ref = ref(x)
    dx_ref = ref.backward(g)
    local = (3, 5, 8 // world)

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        layer = RowParallelLinear(8, 6, group=group, input_is_parallel=input_is_parallel, dtype=F,
                                  rng=np.random.default_rng(8))
        y = layer(block_of(x, local, group.rank) if input_is_parallel else x)
        dx = layer.backward(g)
        return y, dx, layer.weight.grad, layer.bias.grad if layer.bias is not None else None

    for rank, (y, dx, dw, db) in enumerate(run_ranks(world, body)):
        close(y, y_ref)
        close(dx, block_of(dx_ref, local, rank) if input_is_parallel else dx_ref)
        close(dw, block_of(ref.weight.grad, (6, 8 // world), rank))
        close(db, ref.bias.grad)


def test_from_linear_to_linear_round_trip_and_seeded_init() -> None:
    ref = nn.Linear(4, 6, dtype=F, rng=np.random.default_rng(5))
    assert ref.bias is not None

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        col = ColumnParallelLinear.from_linear(ref, group)
        row = RowParallelLinear.from_linear(ref, group, input_is_parallel=False)
        seeded = ColumnParallelLinear(4, 6, group=group, dtype=F, rng=np.random.default_rng(5))
        full_col, full_row = col.to_linear(), row.to_linear()
        biases = [b.data if b is not None else None for b in (seeded.bias, full_col.bias, full_row.bias)]
        return (col.weight.data, seeded.weight.data, biases[0], full_col.weight.data, biases[1],
                full_row.weight.data, biases[2], row.weight.shape)

    for rank, (cw, sw, sb, fcw, fcb, frw, frb, row_shape) in enumerate(run_ranks(2, body)):
        np.testing.assert_array_equal(cw, ref.weight.data[3 * rank : 3 * rank + 3])
        np.testing.assert_array_equal(sw, cw)
        np.testing.assert_array_equal(sb, ref.bias.data[3 * rank : 3 * rank + 3])
        for w, b in ((fcw, fcb), (frw, frb)):
            np.testing.assert_array_equal(w, ref.weight.data)
            np.testing.assert_array_equal(b, ref.bias.data)
        assert row_shape == (6, 2)


def test_regions_forward_and_backward() -> None:
    world = 2

    def body(group: ProcessGroup) -> list[np.ndarray]:
        r = group.rank
        mine = np.arange(12, dtype=F).reshape(3, 4) + 100 * r
        copy, reduce = CopyToParallelRegion(group), ReduceFromParallelRegion(group)
        gather, scatter = GatherFromParallelRegion(group), ScatterToParallelRegion(group)
        return [copy(mine), copy.backward(mine.copy()), reduce(mine.copy()), reduce.backward(mine),
                gather(mine), gather.backward(np.tile(mine, 2)), scatter(mine), scatter.backward(mine[:, :2].copy())]

    out = run_ranks(world, body)
    per_rank = [np.arange(12, dtype=F).reshape(3, 4) + 100 * r for r in range(world)]
    total = per_rank[0] + per_rank[1]
    both = np.concatenate(per_rank, axis=-1)
    for r, (c_f, c_b, r_f, r_b, g_f, g_b, s_f, s_b) in enumerate(out):
        close(c_f, per_rank[r])
        close(c_b, total)
        close(r_f, total)
        close(r_b, per_rank[r])
        close(g_f, both)
        close(g_b, np.tile(per_rank[r], 2)[:, 4 * r : 4 * r + 4])
        close(s_f, per_rank[r][:, 2 * r : 2 * r + 2])
        close(s_b, np.concatenate([p[:, :2] for p in per_rank], axis=-1))


def test_sizes_that_do_not_divide_are_rejected() -> None:
    def body(group: ProcessGroup) -> list[str]:
        messages = []
        for make in (
            lambda: ColumnParallelLinear(4, 5, group=group, dtype=F),
            lambda: RowParallelLinear(5, 4, group=group, dtype=F),
            lambda: ParallelMLP(4, 7, group, dtype=F),
            lambda: ParallelCausalSelfAttention(6, 3, group, dtype=F),
            lambda: RowParallelLinear(4, 4, group=group, dtype=F)(np.zeros((2, 4))),
        ):
            with pytest.raises(ValueError) as info:
                make()
            messages.append(str(info.value))
        return messages

    messages = run_ranks(2, body)[0]
    assert "out_features (5)" in messages[0] and "group size (2)" in messages[0]
    assert "in_features (5)" in messages[1]
    assert "ParallelMLP hidden (7)" in messages[2]
    assert "n_heads (3)" in messages[3]
    assert "input_is_parallel=False" in messages[4]


def train(model: nn.Module, steps: int, batch: Callable[[int], tuple[np.ndarray, np.ndarray]],
          loss: Any, wrapper: nn.Module | None = None) -> tuple[np.ndarray, np.ndarray]:
    """SGD with momentum for `steps`; returns the first step's output and input gradient."""
    runner = wrapper if wrapper is not None else model
    opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9)
    first: tuple[np.ndarray, np.ndarray] | None = None
    for step in range(steps):
        x, y = batch(step)
        model.zero_grad()
        out = runner(x)
        loss(out, y)
        dx = runner.backward(loss.backward())
        if first is None:
            first = (out.copy(), dx.copy() if dx is not None else np.zeros(0))
        opt.step()
    assert first is not None
    return first


def assert_sharded_params(tp: nn.Module, ref: nn.Module, rank: int) -> None:
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in tp.named_parameters()]
    assert names == list(ref_params)
    for name, p in tp.named_parameters():
        close(p.data, block_of(ref_params[name].data, p.shape, rank))


def mlp_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    return data((4, 3, 8), 100 + step), data((4, 3, 8), 200 + step)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_mlp_training_matches_single_process(world: int) -> None:
    ref = nn.MLP(8, 16, dtype=F, rng=np.random.default_rng(11))
    start = [p.data.copy() for p in ref.parameters()]
    out_ref, dx_ref = train(ref, STEPS, mlp_batch, nn.MSELoss())
    assert max(float(np.abs(a - p.data).max()) for a, p in zip(start, ref.parameters())) > 1e-2

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        tp = ParallelMLP(8, 16, group, dtype=F, rng=np.random.default_rng(11))
        out, dx = train(tp, STEPS, mlp_batch, nn.MSELoss())
        return tp, out, dx

    for rank, (tp, out, dx) in enumerate(run_ranks(world, body)):
        close(out, out_ref)
        close(dx, dx_ref)
        assert_sharded_params(tp, ref, rank)


class TinyLM(nn.Module):
    """Embedding -> (parallel) transformer block -> linear head, tokens in, logits out."""

    def __init__(self, group: ProcessGroup | None, dropout: float = 0.1) -> None:
        super().__init__()
        rng = np.random.default_rng(3)
        self.emb = nn.Embedding(11, 8, dtype=F, rng=rng)
        if group is None:
            self.block: nn.Module = nn.TransformerBlock(8, 4, mlp_ratio=2, dropout=dropout, dtype=F, rng=rng, seed=5)
        else:
            self.block = ParallelTransformerBlock(8, 4, 2, dropout, group, dtype=F, rng=rng, seed=5)
        self.head = nn.Linear(8, 11, dtype=F, rng=rng)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.head(self.block(self.emb(x)))

    def backward(self, grad_out: np.ndarray) -> None:
        return self.emb.backward(self.block.backward(self.head.backward(grad_out)))


def lm_batch(rows: int, dp_rank: int = 0, dp_size: int = 1) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.random.default_rng(300 + step).integers(0, 11, (rows * dp_size, 6))
        mine = tokens[dp_rank * rows : (dp_rank + 1) * rows]
        return mine[:, :-1], mine[:, 1:]

    return batch


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_transformer_block_training_matches_single_process(world: int) -> None:
    ref = TinyLM(None)
    out_ref, _ = train(ref, STEPS, lm_batch(4), nn.CrossEntropyLoss())

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        tp = TinyLM(group)
        out, _ = train(tp, STEPS, lm_batch(4), nn.CrossEntropyLoss())
        return tp, out

    for rank, (tp, out) in enumerate(run_ranks(world, body)):
        close(out, out_ref)
        assert_sharded_params(tp, ref, rank)


def test_from_block_shards_an_existing_block() -> None:
    ref = nn.TransformerBlock(8, 2, mlp_ratio=2, dtype=F, rng=np.random.default_rng(9))
    x, g = data((2, 5, 8), 6), data((2, 5, 8), 7)
    y_ref = ref(x)
    dx_ref = ref.backward(g)

    def body(group: ProcessGroup) -> tuple[Any, ...]:
        tp = ParallelTransformerBlock.from_block(ref, group)
        y = tp(x)
        return tp, y, tp.backward(g)

    for rank, (tp, y, dx) in enumerate(run_ranks(2, body)):
        close(y, y_ref)
        close(dx, dx_ref)
        for name, p in tp.named_parameters():
            close(p.grad, block_of(dict(ref.named_parameters())[name].grad, p.shape, rank))


def test_tensor_and_data_parallel_on_a_2x2_mesh() -> None:
    """TP inside each row of the mesh, DDP across its columns; dropout off, since the reference
    draws one mask for the concatenated batch where each dp rank draws its own."""
    rows = 2
    ref = TinyLM(None, dropout=0.0)
    train(ref, STEPS, lm_batch(2 * rows), nn.CrossEntropyLoss())

    def body(world: ProcessGroup) -> tuple[Any, ...]:
        mesh = DeviceMesh((2, 2), ("dp", "tp"), group=world)
        try:
            model = TinyLM(mesh.get_group("tp"), dropout=0.0)
            ddp = DDP(model, mesh.get_group("dp"))
            dp_rank = mesh.get_local_rank("dp")
            train(model, STEPS, lm_batch(rows, dp_rank, 2), nn.CrossEntropyLoss(), wrapper=ddp)
            ddp.remove_hooks()
            return model, mesh.get_local_rank("tp")
        finally:
            mesh.destroy()

    for model, tp_rank in run_ranks(4, body):
        assert_sharded_params(model, ref, tp_rank)


def test_fsdp_over_data_parallel_with_tensor_parallel_inside() -> None:
    """2-D parallelism as torchtitan does it: TP inside each row of a 2x2 mesh, FSDP (FULL_SHARD) across its
    columns, sharding each rank's TP slices. The gathered TP slices match the single-process model."""
    rows = 2
    ref = TinyLM(None, dropout=0.0)
    train(ref, STEPS, lm_batch(2 * rows), nn.CrossEntropyLoss())

    def body(world: ProcessGroup) -> tuple[Any, ...]:
        mesh = DeviceMesh((2, 2), ("dp", "tp"), group=world)
        try:
            model = TinyLM(mesh.get_group("tp"), dropout=0.0)
            names = [n for n, _ in model.named_parameters()]
            shapes = [p.shape for p in model.parameters()]
            fsdp = FSDP(model, mesh.get_group("dp"))
            opt = SGD(list(fsdp.parameters()), lr=0.1, momentum=0.9)
            loss = nn.CrossEntropyLoss()
            batch = lm_batch(rows, mesh.get_local_rank("dp"), 2)
            for step in range(STEPS):
                x, y = batch(step)
                fsdp.zero_grad()
                loss(fsdp(x), y)
                fsdp.backward(loss.backward())
                opt.step()
            state = fsdp.full_state_dict()
            stats = fsdp.memory_stats()
            assert stats["parameters"] < stats["unsharded_parameters"]
            return {n: state[n] for n in names}, mesh.get_local_rank("tp")
        finally:
            mesh.destroy()

    ref_params = dict(ref.named_parameters())
    for params, tp_rank in run_ranks(4, body):
        assert list(params) == list(ref_params)
        for name, value in params.items():
            close(value, block_of(ref_params[name].data, value.shape, tp_rank))
