"""Pipeline over the real TCP backend, ranks as threads: parity with single-process training of the
whole Sequential on the whole batch, for every schedule, the eval path, stashing and failures.

Parity tolerance: float64 throughout. The pipeline computes the same per-row forward; its
gradient is the sum over microbatches of (rows_m / N) * (microbatch mean gradient), the reference's
one mean over the batch: the same terms summed in another order, a few ulps (~1e-16 relative)
apart. Three SGD steps with momentum keep parameters within ~1e-14. We assert 1e-9, which a
missing microbatch, a wrong weight, a gradient sent to the wrong stage or a stale stash misses by
many orders of magnitude (those errors are O(1e-2) here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.distributed.forms.seed import sync_gradients
from axond.errors import DistributedError
from axond.nn.optim import SGD
from axond.parallel.mesh import DeviceMesh
from axond.parallel.pipeline import Pipeline, PipelineSchedule
from axond.testing import run_on, run_threads, thread_groups

TOL = 1e-9
STEPS = 3
ROWS = 11
GPIPE, ONE_F_ONE_B, INTERLEAVED = PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


def mlp() -> nn.Sequential:
    rng = np.random.default_rng(0)
    f = np.float64
    return nn.Sequential(
        nn.Linear(5, 8, dtype=f, rng=rng), nn.Tanh(), nn.Linear(8, 8, dtype=f, rng=rng), nn.GELU(),
        nn.Linear(8, 8, dtype=f, rng=rng), nn.Tanh(), nn.LayerNorm(8, dtype=f), nn.Linear(8, 3, dtype=f, rng=rng),
    )


def tiny_lm() -> nn.Sequential:
    rng = np.random.default_rng(0)
    f = np.float64
    return nn.Sequential(nn.Embedding(11, 8, dtype=f, rng=rng), nn.TransformerBlock(8, 2, mlp_ratio=2, dtype=f, rng=rng),
                         nn.LayerNorm(8, dtype=f), nn.Linear(8, 11, dtype=f, rng=rng))


def mlp_data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((ROWS, 5)), rng.integers(0, 3, ROWS)


def lm_data(step: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(200 + step).integers(0, 11, (ROWS, 7))
    return tokens[:, :-1], tokens[:, 1:]


def reference(make: Callable[[], nn.Sequential], data: Callable[[int], Any]) -> tuple[list[float], list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Losses and gradients of each step, and final parameters, training the whole model on the whole batch."""
    model = make()
    opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses, grads = [], []
    for step in range(STEPS):
        x, y = data(step)
        model.zero_grad()
        losses.append(loss_fn(model(x), y))
        model.backward(loss_fn.backward())
        grads.append({n: p.grad.copy() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return losses, grads, {n: p.data.copy() for n, p in model.named_parameters()}


def train_pipeline(group: ProcessGroup, make: Callable[[], nn.Sequential], data: Callable[[int], Any],
                   **kwargs: Any) -> tuple[list[float], list[dict[str, np.ndarray]], dict[str, np.ndarray], int]:
    pipe = Pipeline(make(), group, loss_fn=nn.CrossEntropyLoss(), **kwargs)
    params = list(pipe.parameters())
    opt = SGD(params, lr=0.1, momentum=0.9) if params else None  # a stage of only activations has none
    losses, grads = [], []
    for step in range(STEPS):
        x, y = data(step)
        pipe.zero_grad()
        losses.append(pipe.step(x if pipe.is_first else None, y if pipe.is_last else None))
        grads.append({n: p.grad.copy() for n, p in pipe.named_parameters() if p.grad is not None})
        if opt is not None:
            opt.step()
    return losses, grads, {n: p.data.copy() for n, p in pipe.named_parameters()}, pipe.peak_stashed


def check_parity(results: list[Any], make: Callable[[], nn.Sequential], data: Callable[[int], Any]) -> None:
    ref_losses, ref_grads, ref_params = reference(make, data)
    for losses, _, _, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0)
    for step in range(STEPS):
        got = {n: g for _, grads, _, _ in results for n, g in grads[step].items()}
        assert sorted(got) == sorted(ref_grads[step]), "every parameter's gradient lives on exactly one rank"
        for name, g in got.items():
            np.testing.assert_allclose(g, ref_grads[step][name], rtol=0, atol=TOL, err_msg=name)
    params = {n: p for _, _, ps, _ in results for n, p in ps.items()}
    assert sorted(params) == sorted(ref_params)
    for name, p in params.items():
        np.testing.assert_allclose(p, ref_params[name], rtol=0, atol=TOL, err_msg=name)


CASES = [
    *[(s, p, m, 1) for s in (GPIPE, ONE_F_ONE_B) for p in (2, 3) for m in (1, p, 2 * p + 1)],
    (INTERLEAVED, 2, 2, 2), (INTERLEAVED, 2, 4, 2), (INTERLEAVED, 3, 3, 1), (INTERLEAVED, 3, 6, 1),
    (INTERLEAVED, 4, 4, 2), (ONE_F_ONE_B, 4, 9, 1), (ONE_F_ONE_B, 1, 3, 1), (INTERLEAVED, 1, 2, 3),
]


@pytest.mark.parametrize("schedule,p,m,v", CASES, ids=[f"{s.name}-P{p}-M{m}-v{v}" for s, p, m, v in CASES])
def test_parity_with_single_process_training(schedule: PipelineSchedule, p: int, m: int, v: int) -> None:
    results = run_ranks(p, lambda g: train_pipeline(g, mlp, mlp_data, schedule=schedule, num_microbatches=m,
                                                    virtual_stages=v))
    check_parity(results, mlp, mlp_data)


@pytest.mark.parametrize("schedule,v", [(ONE_F_ONE_B, 1), (INTERLEAVED, 2)])
def test_transformer_parity_with_token_inputs_and_3d_activations(schedule: PipelineSchedule, v: int) -> None:
    results = run_ranks(2, lambda g: train_pipeline(g, tiny_lm, lm_data, schedule=schedule, num_microbatches=4,
                                                    virtual_stages=v, split_points=[1, 2, 3] if v == 2 else [2]))
    check_parity(results, tiny_lm, lm_data)


def test_list_of_stages_and_explicit_split_points() -> None:
    def stages() -> list[nn.Module]:
        layers = list(mlp())
        return [nn.Sequential(*layers[:3]), nn.Sequential(*layers[3:])]

    def fn(group: ProcessGroup) -> tuple[float, list[tuple[str, Any]]]:
        pipe = Pipeline(stages(), group, num_microbatches=3, loss_fn=nn.CrossEntropyLoss())
        x, y = mlp_data(0)
        return pipe.step(x, y), [(n, p.grad) for n, p in pipe.named_parameters()]

    results = run_ranks(2, fn)
    whole = nn.Sequential(*stages())
    loss_fn = nn.CrossEntropyLoss()
    x, y = mlp_data(0)
    loss = loss_fn(whole(x), y)
    whole.backward(loss_fn.backward())
    assert results[0][0] == pytest.approx(loss, rel=TOL) and results[1][0] == pytest.approx(loss, rel=TOL)
    ref = [p.grad for p in whole.parameters() if p.grad is not None]
    got = [g for _, grads in results for _, g in grads]
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=0, atol=TOL)


@pytest.mark.parametrize("schedule,p,m,v", [(GPIPE, 3, 4, 1), (ONE_F_ONE_B, 2, 5, 1), (INTERLEAVED, 2, 4, 2)])
def test_forward_only_matches_the_whole_model(schedule: PipelineSchedule, p: int, m: int, v: int) -> None:
    x, _ = mlp_data(0)

    def fn(group: ProcessGroup) -> np.ndarray | None:
        pipe = Pipeline(mlp(), group, schedule=schedule, num_microbatches=m, virtual_stages=v).eval()
        return pipe.forward(x if group.rank == 0 else None)

    results = run_ranks(p, fn)
    assert all(r is None for r in results[:-1])
    np.testing.assert_allclose(results[-1], mlp().eval()(x), rtol=0, atol=TOL)


def test_stashed_activations_gpipe_holds_every_microbatch_1f1b_at_most_p() -> None:
    p, m = 3, 7
    peaks = {}
    for schedule in (GPIPE, ONE_F_ONE_B):
        results = run_ranks(p, lambda g: train_pipeline(g, mlp, mlp_data, schedule=schedule, num_microbatches=m))
        peaks[schedule] = [r[3] for r in results]
    assert peaks[GPIPE] == [m] * p
    assert peaks[ONE_F_ONE_B] == [p - r for r in range(p)] and max(peaks[ONE_F_ONE_B]) <= p


def test_bad_arguments_raise_clear_errors() -> None:
    def fn(group: ProcessGroup) -> list[str]:
        errors = []
        cases: list[Callable[[], Any]] = [
            lambda: Pipeline(mlp(), group, schedule=INTERLEAVED, num_microbatches=3, virtual_stages=2),
            lambda: Pipeline(mlp(), group, schedule=GPIPE, num_microbatches=2, virtual_stages=2),
            lambda: Pipeline([nn.Linear(2, 2)], group),
            lambda: Pipeline(mlp(), group, num_microbatches=12, loss_fn=nn.MSELoss()).step(*mlp_data(0)),
            lambda: Pipeline(mlp(), group, num_microbatches=2).step(*mlp_data(0)),
            lambda: Pipeline(mlp(), group, num_microbatches=2, loss_fn=nn.MSELoss()).step(None, None),
        ]
        for case in cases:
            with pytest.raises(ValueError) as info:
                case()
            errors.append(str(info.value))
        return errors

    errors = run_ranks(2, fn)[0]
    assert "divisible by the pipeline size" in errors[0] and "num_microbatches=3" in errors[0]
    assert "virtual_stages=2" in errors[1]
    assert "need 2 stage modules, got 1" in errors[2]
    assert "11 rows, fewer than num_microbatches=12" in errors[3]
    assert "needs loss_fn" in errors[4]
    assert "needs x there (got None)" in errors[5]


class Boom(nn.Module):
    """Identity that raises on its `at`-th forward: a stage failing mid-schedule."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("stage exploded")
        return x

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        return grad_out


def boom_model(rank: int) -> nn.Sequential:
    layers = list(mlp())
    return nn.Sequential(*layers[:3], Boom(3 if rank == 1 else 0), *layers[3:])


def failing_step(group: ProcessGroup, after: Callable[[], object]) -> tuple[BaseException, float]:
    """Step a 3-stage 1F1B pipeline whose stage 1 raises on its third microbatch; return (error, seconds)."""
    pipe = Pipeline(boom_model(group.rank), group, num_microbatches=6, loss_fn=nn.CrossEntropyLoss(),
                    split_points=[3, 6])
    start = time.monotonic()
    try:
        pipe.step(*mlp_data(0))
    except (DistributedError, RuntimeError) as e:
        if group.rank == 1:
            after()
        return e, time.monotonic() - start
    raise AssertionError(f"rank {group.rank} finished a step whose stage 1 failed")


def test_a_failing_stage_that_exits_fails_the_others_fast() -> None:
    results = run_ranks(3, lambda g: failing_step(g, lambda: None))
    assert isinstance(results[1][0], RuntimeError) and "stage exploded" in str(results[1][0])
    for rank in (0, 2):
        error, seconds = results[rank]
        assert isinstance(error, DistributedError), repr(error)
        assert seconds < 10.0, f"rank {rank} took {seconds:.1f} s to notice (op timeout 20 s)"


def test_a_failing_stage_that_stays_alive_aborts_the_others_at_once() -> None:
    """The failing rank aborts the group (ProcessGroup.abort): the others raise quoting its error long
    before their 20 s op timeout, although its process and sockets stay alive."""
    groups = thread_groups(3, options=BackendOptions(timeout=20.0))
    others_done = threading.Event()
    pending, lock = {0, 2}, threading.Lock()

    def fn(group: ProcessGroup) -> tuple[BaseException, float]:
        try:
            return failing_step(group, lambda: others_done.wait(30.0))
        finally:
            with lock:
                pending.discard(group.rank)
                if not pending:
                    others_done.set()

    try:
        results = run_on(groups, fn, timeout=40.0)
    finally:
        others_done.set()
        for g in groups:
            g.destroy()
    assert isinstance(results[1][0], RuntimeError)
    for rank in (0, 2):
        error, seconds = results[rank]
        assert isinstance(error, DistributedError), repr(error)
        assert "stage exploded" in str(error), str(error)
        assert seconds < 5.0, f"rank {rank} needed {seconds:.1f} s although the failing stage aborted the group"


def test_pipeline_with_data_parallel_replicas_on_a_2x2_mesh() -> None:
    """DP x PP: each row of a (dp=2, pp=2) mesh pipelines its half of the batch; the stage gradients are then
    averaged over the dp group (sync_gradients). Parameters match single-process training on the whole batch."""

    def data(step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(300 + step)
        return rng.standard_normal((12, 5)), rng.integers(0, 3, 12)

    def fn(world: ProcessGroup) -> dict[str, np.ndarray]:
        mesh = DeviceMesh((2, 2), ("dp", "pp"), group=world)
        try:
            dp, pp = mesh.get_group("dp"), mesh.get_group("pp")
            pipe = Pipeline(mlp(), pp, schedule=ONE_F_ONE_B, num_microbatches=3, loss_fn=nn.CrossEntropyLoss())
            params = list(pipe.parameters())
            opt = SGD(params, lr=0.1, momentum=0.9)
            rows = slice(6 * dp.rank, 6 * dp.rank + 6)
            for step in range(STEPS):
                x, y = data(step)
                pipe.zero_grad()
                pipe.step(x[rows] if pipe.is_first else None, y[rows] if pipe.is_last else None)
                sync_gradients([p.grad for p in params if p.grad is not None], dp)
                opt.step()
            return {n: p.data.copy() for n, p in pipe.named_parameters()}
        finally:
            mesh.destroy()

    results = run_ranks(4, fn)
    _, _, want = reference(mlp, data)
    got: dict[str, np.ndarray] = {}
    for params in results:
        for name, value in params.items():
            if name in got:
                np.testing.assert_array_equal(value, got[name], err_msg=f"dp replicas of {name} differ")
            got[name] = value
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        np.testing.assert_allclose(value, want[name], rtol=0, atol=TOL, err_msg=name)
