"""DDP over the real TCP backend, ranks as threads: parity with single-process training on the
concatenated batch, gradient accumulation, several buckets, a subgroup, the overlap itself, buffer
broadcast and failure behaviour.

Parity tolerance: float64 throughout. DDP's gradient is the average over ranks of per-rank batch
means, the reference's is one mean over the concatenated batch: the same sum in a different order,
so each step differs by a few ulps (~1e-16 relative) and 20 steps of SGD with momentum keep the
parameters within ~1e-13. We assert 1e-9 (tighter than the 1e-6 asked for), which any wrong
average, missed bucket or stale gradient exceeds by orders of magnitude.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.errors import BypassedBackwardError, DistributedError
from axond.nn.optim import SGD
from axond.parallel import DDP, DDPConfig, DistributedDataParallel, GradSyncStrategy
from axond.testing import run_threads
from parity_models import TinyLM, lm_data, mlp, mlp_data

TOL = 1e-9
STEPS = 20
BATCH = 4


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any], timeout: float = 60.0, op_timeout: float = 30.0) -> list[Any]:
    """fn(group) on `world` threads over the TCP backend (axond.testing), results by rank."""
    return run_threads(fn, world, timeout, options=BackendOptions(timeout=op_timeout))


def train_reference(make: Callable[[int], nn.Module], data: Callable[[int, int], Any], world: int, accum: int = 1) -> list[np.ndarray]:
    model = make(0)
    opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = data(step, world * BATCH * accum)
        model.zero_grad()
        loss(model(x), y)
        model.backward(loss.backward())
        opt.step()
    return [p.data.copy() for p in model.parameters()]


def train_ddp(group: ProcessGroup, make: Callable[[int], nn.Module], data: Callable[[int, int], Any],
              accum: int = 1, **ddp_kwargs: Any) -> tuple[list[np.ndarray], DistributedDataParallel]:
    model = make(0 if group.rank == 0 else 100 + group.rank)  # other ranks start elsewhere: DDP must broadcast rank 0
    ddp = DDP(model, group, **ddp_kwargs)
    opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = nn.CrossEntropyLoss()
    world, rank = group.size, group.rank
    for step in range(STEPS):
        x, y = data(step, world * BATCH * accum)
        micro = [(x[i::accum], y[i::accum]) for i in range(accum)] if accum > 1 else [(x, y)]
        model.zero_grad()
        for a, (mx, my) in enumerate(micro):
            lx, ly = mx[rank * BATCH:(rank + 1) * BATCH], my[rank * BATCH:(rank + 1) * BATCH]
            last = a == len(micro) - 1
            ctx = ddp.no_sync() if not last else _nullcontext()
            with ctx:
                loss(ddp(lx), ly)
                ddp.backward(loss.backward(scale=1.0 / accum))
        if ddp.strategy is GradSyncStrategy.NO_SYNC:
            ddp.sync_gradients()
        opt.step()
    return [p.data.copy() for p in model.parameters()], ddp


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def assert_params_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)


def test_reference_depends_on_the_data() -> None:
    """Guards the parity tests: training moves the parameters far beyond the tolerance."""
    start = [p.data for p in mlp(0).parameters()]
    end = train_reference(mlp, mlp_data, 2)
    assert max(float(np.abs(a - b).max()) for a, b in zip(start, end)) > 1e-2


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_single_process(world: int) -> None:
    want = train_reference(mlp, mlp_data, world)
    for got, ddp in run_ranks(world, lambda g: train_ddp(g, mlp, mlp_data)):
        assert_params_close(got, want)
        assert len(ddp.buckets) == 1


def test_ddp_transformer_several_buckets_three_ranks() -> None:
    want = train_reference(TinyLM, lm_data, 3)
    for got, ddp in run_ranks(3, lambda g: train_ddp(g, TinyLM, lm_data, bucket_cap_mb=0.002)):
        assert_params_close(got, want)
        assert len(ddp.buckets) >= 3
        assert sum(len(b.params) for b in ddp.buckets) == len(list(ddp.parameters()))


def test_ddp_no_sync_accumulation() -> None:
    want = train_reference(mlp, mlp_data, 2, accum=3)
    for got, _ in run_ranks(2, lambda g: train_ddp(g, mlp, mlp_data, accum=3, bucket_cap_mb=0.001)):
        assert_params_close(got, want)


@pytest.mark.parametrize("strategy", [GradSyncStrategy.SYNCHRONOUS, GradSyncStrategy.NO_SYNC])
def test_ddp_other_strategies(strategy: GradSyncStrategy) -> None:
    want = train_reference(mlp, mlp_data, 2)
    for got, _ in run_ranks(2, lambda g: train_ddp(g, mlp, mlp_data, strategy=strategy, bucket_cap_mb=0.001)):
        assert_params_close(got, want)


def test_ddp_over_a_subgroup() -> None:
    want = train_reference(mlp, mlp_data, 2)

    def body(world: ProcessGroup) -> Any:
        sub = world.new_group([0, 2])
        try:
            if world.rank == 1:
                return None
            return train_ddp(sub, mlp, mlp_data, bucket_cap_mb=0.001)[0]
        finally:
            sub.destroy()

    results = run_ranks(3, body)
    assert results[1] is None
    assert_params_close(results[0], want)
    assert_params_close(results[2], want)


def test_overlap_bucket_launched_before_backward_ends() -> None:
    """Bucket 0 (the last layer's gradients) is sent, and even finishes, while backward still runs."""

    def body(group: ProcessGroup) -> tuple[list[tuple[float, str, int]], bool]:
        model = mlp(0)
        ddp = DDP(model, group, bucket_cap_mb=0.001)
        done_during_backward = threading.Event()

        def first_layer_begins(module: nn.Module, grad: np.ndarray) -> None:
            ddp.synchronizer.record("first_layer_backward_begin")
            work = ddp.buckets[0].work
            for _ in range(500):  # up to 5 s: the comm thread progresses while backward is paused here
                if work is not None and work.is_completed():
                    done_during_backward.set()
                    break
                threading.Event().wait(0.01)

        model[0].register_backward_pre_hook(first_layer_begins)
        loss = nn.CrossEntropyLoss()
        x, y = mlp_data(0, 8)
        loss(ddp(x), y)
        ddp.backward(loss.backward())
        return list(ddp.events), done_during_backward.is_set()

    for events, done_during_backward in run_ranks(2, body):
        assert done_during_backward, "bucket 0's all-reduce did not complete while backward was still running"
        names = [(name, idx) for _, name, idx in events]
        order = {key: i for i, key in reversed(list(enumerate(names)))}
        first_layer = order[("first_layer_backward_begin", -1)]
        module_end = order[("module_backward_end", -1)]
        launches = [i for i, (name, _) in enumerate(names) if name == "launch"]
        assert len(launches) >= 3
        assert order[("launch", 0)] < first_layer < module_end, names
        assert sum(i < module_end for i in launches) >= len(launches) - 1, names
        assert max(i for i, (name, _) in enumerate(names) if name == "reduced") > module_end


class WithBuffer(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, dtype=np.float64, rng=np.random.default_rng(int(value)))
        self.register_buffer("stat", np.full(3, value))

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.lin(x)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.lin.backward(grad_out)


def test_construction_and_forward_broadcast_from_rank0() -> None:
    def body(group: ProcessGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        module = WithBuffer(float(group.rank + 1))
        ddp = DDP(module, group)
        after_init = module.stat.copy()
        module.stat = np.full(3, 10.0 * (group.rank + 1))
        ddp(np.ones((1, 2)))
        return after_init, module.stat.copy(), module.lin.weight.data.copy()

    results = run_ranks(2, body)
    for after_init, after_forward, weight in results:
        np.testing.assert_array_equal(after_init, np.full(3, 1.0))
        np.testing.assert_array_equal(after_forward, np.full(3, 10.0))
        np.testing.assert_array_equal(weight, results[0][2])


def test_dead_peer_raises_instead_of_hanging() -> None:
    def body(group: ProcessGroup) -> str:
        ddp = DDP(mlp(0), group)
        if group.rank == 1:
            return "left"
        loss = nn.CrossEntropyLoss()
        x, y = mlp_data(0, 4)
        loss(ddp(x), y)
        with pytest.raises(DistributedError) as info:
            ddp.backward(loss.backward())
        return str(info.value)

    message = run_ranks(2, body, op_timeout=3.0)[0]
    assert "all_reduce" in message


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="axond.nn.Module"):
        DDP("model", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDPConfig(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="timeout"):
        DDPConfig(timeout=-1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(mlp(0))


class PartlyUsed(nn.Module):
    """A frozen first layer, a trained second one and a head that forward never uses."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.frozen = nn.Linear(6, 8, dtype=np.float64, rng=rng)
        self.used = nn.Linear(8, 3, dtype=np.float64, rng=rng)
        self.unused = nn.Linear(3, 3, dtype=np.float64, rng=rng)
        for p in self.frozen.parameters():
            p.requires_grad = False

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.used(self.frozen(x))

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.frozen.backward(self.used.backward(grad_out))


def test_frozen_and_unused_parameters() -> None:
    want = train_reference(PartlyUsed, mlp_data, 2)
    for got, ddp in run_ranks(2, lambda g: train_ddp(g, PartlyUsed, mlp_data, bucket_cap_mb=0.0001)):
        assert_params_close(got, want)
        synced = {id(p) for b in ddp.buckets for p in b.params}
        module = ddp.module
        assert not any(id(p) in synced for p in module.frozen.parameters())
        assert all(p.grad is None for p in module.unused.parameters()), "no rank used it: grad stays None"


class Tied(nn.Module):
    """Two layers sharing one weight: its gradient is final only after both backwards."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.a = nn.Linear(6, 6, dtype=np.float64, rng=rng)
        self.act = nn.Tanh()
        self.b = nn.Linear(6, 6, dtype=np.float64, rng=rng)
        self.b.weight = self.a.weight
        self.head = nn.Linear(6, 3, dtype=np.float64, rng=rng)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.head(self.b(self.act(self.a(x))))

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return self.a.backward(self.act.backward(self.b.backward(self.head.backward(grad_out))))


def test_shared_weight_is_reduced_after_its_last_use() -> None:
    want = train_reference(Tied, mlp_data, 2)
    for got, ddp in run_ranks(2, lambda g: train_ddp(g, Tied, mlp_data, bucket_cap_mb=0.0001)):
        assert_params_close(got, want)
        assert any(b.launch_only_at_end for b in ddp.buckets)


@pytest.mark.parametrize("caught_at", ["step", "forward"])
def test_backward_that_bypasses_ddp_raises_on_every_rank(caught_at: str) -> None:
    """The inner model's backward leaves local gradients (the replicas would drift apart silently): the next
    optimizer step (before it changes anything) or DDP forward raises, saying which backward to call."""
    def body(group: ProcessGroup) -> str:
        model = mlp(0)
        ddp = DDP(model, group)
        opt = SGD(list(model.parameters()), lr=0.1)
        loss = nn.CrossEntropyLoss()
        x, y = mlp_data(0, BATCH)
        loss(ddp(x + group.rank), y)
        model.backward(loss.backward())
        before = [p.data.copy() for p in model.parameters()]
        with pytest.raises(BypassedBackwardError) as info:
            opt.step() if caught_at == "step" else ddp(x)
        assert all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))
        return str(info.value)

    for message in run_ranks(2, body):
        assert "without ddp.backward" in message and "Call ddp.backward(grad) instead of model.backward(grad)" in message
        assert "group 'world'" in message and "drift apart" in message


def test_legitimate_loops_do_not_trip_the_bypass_check() -> None:
    """Eval forwards without backward, several forwards, zero_grad, no_sync accumulation, the inner backward
    followed by sync_gradients(), and the module on its own after remove_hooks(): no error, replicas equal."""
    def body(group: ProcessGroup) -> list[np.ndarray]:
        model = mlp(0 if group.rank == 0 else 7)
        ddp = DDP(model, group)
        opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9)
        loss = nn.CrossEntropyLoss()
        x, y = mlp_data(group.rank, BATCH)
        ddp.eval()
        ddp(x)
        ddp(x)
        ddp.train()
        opt.zero_grad()
        opt.step()
        for micro in range(3):
            with ddp.no_sync() if micro < 2 else _nullcontext():
                loss(ddp(x[micro:]), y[micro:])
                ddp.backward(loss.backward())
        opt.step()
        opt.zero_grad()
        loss(ddp(x), y)
        model.backward(loss.backward())
        ddp.sync_gradients()
        opt.step()
        ddp(x)
        ddp.remove_hooks()
        for p in model.parameters():
            p.grad = None
        loss(model(x), y)
        model.backward(loss.backward())
        ddp.sync_gradients()
        opt.step()
        return [p.data.copy() for p in model.parameters()]

    first, second = run_ranks(2, body)
    assert_params_close(second, first)


def test_wrapping_a_model_again_leaves_the_old_wrapper_quiet() -> None:
    """A model wrapped a second time (e.g. over a new group) still carries the first wrapper's hooks: they
    see the new wrapper's backward, which is no bypass. Training through the new one matches the reference."""
    want = train_reference(mlp, mlp_data, 2)

    def body(group: ProcessGroup) -> tuple[list[np.ndarray], DistributedDataParallel]:
        def rewrapped(seed: int) -> nn.Module:
            model = mlp(seed)
            DDP(model, group)
            return model

        return train_ddp(group, rewrapped, mlp_data)

    for got, _ in run_ranks(2, body):
        assert_params_close(got, want)
