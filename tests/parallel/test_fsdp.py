"""FSDP over the real TCP backend, ranks as threads: parity of every sharding strategy with
single-process training on the concatenated batch, CPU offload, no_sync accumulation, nested units,
the memory actually held per rank, state dicts and the errors users meet.

Parity tolerance: float64 throughout. A rank's reduce-scattered gradient is the average over ranks
of per-rank batch means, the reference's one mean over the concatenated batch: the same sum in a
different order, a few ulps (~1e-16 relative) per step. SGD with momentum and AdamW (whose update
m / (sqrt(v) + eps) is a smooth function of the gradient at these magnitudes) carry that through 6
steps to ~1e-14. We assert 1e-9, which a wrong average, a stale gather, a shard written to the wrong
offset or a lost padding element exceeds by orders of magnitude (training moves parameters > 1e-2).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import axond.nn as nn
from axond.distributed.backends.base import BackendOptions
from axond.distributed.process_group import ProcessGroup
from axond.errors import BypassedBackwardError
from axond.nn.optim import SGD, AdamW, Optimizer
from axond.nn.utils import clip_grad_norm_
from axond.parallel.fsdp import FSDP, CPUOffload, FlattenedParameter, FullyShardedDataParallel, ShardingStrategy
from axond.parallel.mesh import DeviceMesh
from axond.testing import run_threads
from parity_models import TinyLM, lm_data, mlp, mlp_data

TOL = 1e-9
STEPS = 6
BATCH = 4
S = ShardingStrategy


def run_ranks(world: int, fn: Callable[[ProcessGroup], Any]) -> list[Any]:
    return run_threads(fn, world, 60.0, options=BackendOptions(timeout=20))


def make_opt(name: str, params: list[nn.Parameter]) -> Optimizer:
    if name == "sgd":
        return SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return AdamW(params, lr=1e-2, weight_decay=1e-2)


class Run:
    """What a training run produced: final parameters by name, outputs and gradients of step 0."""

    def __init__(self, params: dict[str, np.ndarray], outputs: list[np.ndarray], grads: Any) -> None:
        self.params, self.outputs, self.grads = params, outputs, grads
        self.unsynced: list[tuple[int, bool]] = []
        """(full_grad_numel, every shard .grad still None) after each no_sync backward."""


def train_reference(make: Callable[[int], nn.Module], data: Callable[[int, int], Any], world: int,
                    opt_name: str, accum: int = 1) -> Run:
    model = make(0)
    opt = make_opt(opt_name, list(model.parameters()))
    loss = nn.CrossEntropyLoss()
    outputs, grads = [], {}
    for step in range(STEPS):
        x, y = data(step, world * BATCH * accum)
        model.zero_grad()
        out = model(x)
        outputs.append(out.copy())
        loss(out, y)
        model.backward(loss.backward())
        if step == 0:
            grads = {n: p.grad.copy() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return Run({k: v.copy() for k, v in model.state_dict().items()}, outputs, grads)


def train_fsdp(pg: ProcessGroup, make: Callable[[int], nn.Module], data: Callable[[int, int], Any], opt_name: str,
               dp_rank: int, dp_size: int, /, accum: int = 1, **kwargs: Any) -> Run:
    """Each data-parallel rank trains on its rows of the reference batch; rank 0's model is the start."""
    fsdp = FSDP(make(0 if pg.rank == 0 else 100 + pg.rank), **kwargs)
    opt = make_opt(opt_name, list(fsdp.parameters()))
    loss = nn.CrossEntropyLoss()
    outputs, grads, unsynced = [], [], []
    for step in range(STEPS):
        x, y = data(step, dp_size * BATCH * accum)
        micro = [(x[i::accum], y[i::accum]) for i in range(accum)]
        fsdp.zero_grad()
        for a, (mx, my) in enumerate(micro):
            rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
            sync = a == accum - 1
            with (fsdp.no_sync() if not sync else _Null()):
                out = fsdp(mx[rows])
                if accum == 1:
                    outputs.append(out.copy())
                loss(out, my[rows])
                fsdp.backward(loss.backward(scale=1.0 / accum))
            if not sync:
                unsynced.append((fsdp.memory_stats()["full_gradients"] // fsdp.units[0].dtype.itemsize, all(p.grad is None for p in fsdp.parameters())))
        if step == 0:
            grads = [(u.names, u.layout, np.array(u.shard.grad, copy=True)) for u in fsdp.units]
        opt.step()
    run = Run(dict(fsdp.full_state_dict()), outputs, grads)
    run.unsynced = unsynced
    return run


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def assert_params_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=TOL, atol=TOL, err_msg=k)


def assert_grads_close(shard_runs: list[Run], want: dict[str, np.ndarray]) -> None:
    """Concatenate the step-0 gradient shards of one shard group and compare the unflattened result."""
    for u, (names, layout, _) in enumerate(shard_runs[0].grads):
        flat = np.concatenate([r.grads[u][2] for r in shard_runs])
        for ns, g in zip(names, layout.views(flat)):
            np.testing.assert_allclose(g, want[ns[0]], rtol=TOL, atol=TOL, err_msg=ns[0])


def assert_run_matches(runs: list[Run], want: Run, shard_groups: list[list[int]]) -> None:
    for rank, run in enumerate(runs):
        assert_params_close(run.params, want.params)
        dp_rank = rank
        for step, out in enumerate(run.outputs):
            np.testing.assert_allclose(out, want.outputs[step][dp_rank * BATCH:(dp_rank + 1) * BATCH], rtol=TOL, atol=TOL)
    for members in shard_groups:
        assert_grads_close([runs[r] for r in members], want.grads)


def test_reference_depends_on_the_data() -> None:
    """Guards the parity tests: training moves the parameters far beyond the tolerance."""
    start = mlp(0).state_dict()
    for opt in ("sgd", "adamw"):
        end = train_reference(mlp, mlp_data, 2, opt).params
        assert max(float(np.abs(start[k] - end[k]).max()) for k in start) > 1e-2


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD])
def test_fsdp_matches_single_process(strategy: ShardingStrategy, world: int, opt: str) -> None:
    want = train_reference(mlp, mlp_data, world, opt)
    runs = run_ranks(world, lambda g: train_fsdp(g, mlp, mlp_data, opt, g.rank, g.size, group=g, sharding_strategy=strategy))
    groups = [[r] for r in range(world)] if strategy is S.NO_SHARD else [list(range(world))]
    assert_run_matches(runs, want, groups)


@pytest.mark.parametrize("opt,prefetch", [("sgd", False), ("adamw", False), ("adamw", True)])
def test_hybrid_shard_on_a_2x2_mesh(opt: str, prefetch: bool) -> None:
    want = train_reference(mlp, mlp_data, 4, opt)

    def body(g: ProcessGroup) -> tuple[Run, int]:
        mesh = DeviceMesh((2, 2), ("replicate", "shard"), group=g)
        try:
            run = train_fsdp(g, mlp, mlp_data, opt, g.rank, g.size, sharding_strategy=S.HYBRID_SHARD, mesh=mesh,
                             wrap=lambda m: isinstance(m, nn.Linear), forward_prefetch=prefetch,
                             backward_prefetch=prefetch)
            return run, mesh.get_group("shard").size
        finally:
            mesh.destroy()

    results = run_ranks(4, body)
    assert all(size == 2 for _, size in results)
    assert_run_matches([r for r, _ in results], want, [[0, 1], [2, 3]])


@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.SHARD_GRAD_OP])
def test_nested_units_transformer_three_ranks(strategy: ShardingStrategy) -> None:
    """Units chosen by a predicate (every Linear) and by a list: same training as the single process."""
    want = train_reference(TinyLM, lm_data, 3, "adamw")

    def body(g: ProcessGroup) -> tuple[Run, Run]:
        by_type = train_fsdp(g, TinyLM, lm_data, "adamw", g.rank, 3, group=g, sharding_strategy=strategy,
                             wrap=lambda m: isinstance(m, nn.Linear))
        model = TinyLM(0)
        by_list = train_fsdp(g, lambda seed: model, lm_data, "adamw", g.rank, 3, group=g, sharding_strategy=strategy,
                             wrap=[model.block.attn, model.block.mlp])
        return by_type, by_list

    for by_type, by_list in run_ranks(3, body):
        assert len(by_type.grads) == 8  # root (embedding, layer norms) + 7 Linears
        assert len(by_list.grads) == 3
        assert_params_close(by_type.params, want.params)
        assert_params_close(by_list.params, want.params)


def test_cpu_offload_trains_identically_with_numpy_shards() -> None:
    want = train_reference(mlp, mlp_data, 3, "adamw")

    def body(g: ProcessGroup) -> tuple[Run, list[bool]]:
        run = train_fsdp(g, mlp, mlp_data, "adamw", g.rank, 3, group=g, cpu_offload=CPUOffload(offload_params=True))
        fsdp = FSDP(mlp(0), group=g, cpu_offload=CPUOffload(offload_params=True))
        fsdp.backward(_loss_grad(fsdp(mlp_data(0, 4)[0])))
        kinds = [type(p.data) is np.ndarray and type(p.grad) is np.ndarray for p in fsdp.parameters()]
        return run, kinds

    results = run_ranks(3, body)
    assert_run_matches([r for r, _ in results], want, [[0, 1, 2]])
    assert all(all(kinds) and kinds for _, kinds in results)


def _loss_grad(out: np.ndarray) -> np.ndarray:
    return np.ones_like(out) / out.size


@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.NO_SHARD])
def test_no_sync_accumulation(strategy: ShardingStrategy) -> None:
    """Three micro-batches, two under no_sync: the same step as the reference on all of them at once."""
    want = train_reference(mlp, mlp_data, 3, "sgd", accum=3)
    runs = run_ranks(3, lambda g: train_fsdp(g, mlp, mlp_data, "sgd", g.rank, 3, accum=3, group=g, sharding_strategy=strategy))
    padded = 3 * math.ceil(sum(p.size for p in mlp(0).parameters()) / 3) if strategy is S.FULL_SHARD else None
    for run in runs:
        assert_params_close(run.params, want.params)
        assert len(run.unsynced) == 2 * STEPS
        for full_grad_numel, no_shard_grad in run.unsynced:
            assert no_shard_grad  # nothing was reduced inside no_sync
            assert full_grad_numel == (padded or sum(p.size for p in mlp(0).parameters()))


def test_full_shard_holds_one_shard_per_rank() -> None:
    """Per rank: ceil(numel / N) parameter elements between steps, no full buffer alive, and a lower
    peak than SHARD_GRAD_OP because each unit is freed right after its forward."""

    def body(g: ProcessGroup) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP):
            model = TinyLM(0)
            fsdp = FSDP(model, group=g, sharding_strategy=strategy, wrap=lambda m: isinstance(m, nn.Linear))
            opt = AdamW(list(fsdp.parameters()))
            x, _ = lm_data(0, 4)
            fsdp.backward(_loss_grad(fsdp(x)))
            opt.step()
            stats: dict[str, Any] = dict(fsdp.memory_stats())
            stats["unit_numels"] = [u.layout.numel for u in fsdp.units]
            stats["local_arrays"] = sum(p.data.size for p in fsdp.parameters())
            stats["module_param_sizes"] = {n: p.data.size for m in model.modules() for n, p in m.__dict__.items()
                                           if isinstance(p, nn.Parameter)}
            stats["optimizer_numel"] = sum(v.size for st in opt.state for v in st.values() if hasattr(v, "size"))
            fsdp.eval()
            fsdp(x)
            stats["gathered_after_eval_forward"] = fsdp.memory_stats()["gathered"]
            out[strategy.name] = stats
        return out

    total = sum(p.size for p in TinyLM(0).parameters())
    for stats_by in run_ranks(3, body):
        full, zero2 = stats_by["FULL_SHARD"], stats_by["SHARD_GRAD_OP"]
        for stats in (full, zero2):
            # memory_stats() is in bytes: float64 parameters, 8 bytes each
            assert stats["unsharded_parameters"] == 8 * total
            assert stats["parameters"] == 8 * stats["local_arrays"] == 8 * sum(math.ceil(n / 3) for n in stats["unit_numels"])
            assert stats["parameters"] <= 8 * (math.ceil(total / 3) + len(stats["unit_numels"]))
            assert stats["gathered"] == 0 and stats["full_gradients"] == 0
            assert set(stats["module_param_sizes"].values()) == {0}
            assert stats["optimizer_numel"] == 2 * stats["parameters"] // 8
            assert stats["optimizer_state"] == 0  # memory_stats() was not given the optimizer
            assert stats["gathered_after_eval_forward"] == 0
        assert full["peak_gathered"] < zero2["peak_gathered"]
        assert zero2["peak_gathered"] >= 8 * total


def frozen_mlp(seed: int) -> nn.Sequential:
    model = mlp(seed)
    model[0].weight.requires_grad = False
    return model


def test_frozen_parameters_stay_replicated() -> None:
    """A frozen parameter is not flattened: rank 0's copy is broadcast and left alone by training."""
    want = train_reference(frozen_mlp, mlp_data, 3, "adamw")

    def body(g: ProcessGroup) -> tuple[Run, list[str]]:
        run = train_fsdp(g, frozen_mlp, mlp_data, "adamw", g.rank, 3, group=g)
        names = [n for n, p in FSDP(frozen_mlp(0), group=g).named_parameters() if not p.requires_grad]
        return run, names

    for run, names in run_ranks(3, body):
        assert_params_close(run.params, want.params)
        assert names == ["module.0.weight"]
    np.testing.assert_array_equal(want.params["0.weight"], frozen_mlp(0)[0].weight.data)


def test_tied_parameters_within_one_unit() -> None:
    """Two modules sharing one Parameter: one slot in the flat buffer, both names in the state dict;
    sharing across two units is refused with the fix."""

    def tied() -> nn.Sequential:
        rng = np.random.default_rng(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=np.float64, rng=rng), nn.Tanh(), nn.Linear(4, 4, dtype=np.float64, rng=rng))
        model[2].weight = model[0].weight
        return model

    def train(model: nn.Module, steps: int, rank: int, world: int) -> None:
        opt = SGD(list(model.parameters()), lr=0.1)
        for step in range(steps):
            x = np.random.default_rng(step).standard_normal((4, 4))[rank * 4 // world:(rank + 1) * 4 // world]
            model.zero_grad()
            out = model(x)
            model.backward(out / out.size)
            opt.step()

    ref = tied()
    train(ref, 4, 0, 1)

    def body(g: ProcessGroup) -> tuple[dict[str, np.ndarray], int]:
        with pytest.raises(NotImplementedError, match="wrap the modules sharing it into one unit"):
            FSDP(tied(), group=g, wrap=lambda m: isinstance(m, nn.Linear))
        fsdp = FSDP(tied(), group=g)
        train(fsdp, 4, g.rank, g.size)
        return dict(fsdp.full_state_dict()), fsdp.units[0].layout.numel

    for state, numel in run_ranks(2, body):
        assert numel == 16 + 4 + 4
        assert_params_close(state, ref.state_dict())
        np.testing.assert_array_equal(state["0.weight"], state["2.weight"])


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_state_dict_round_trip_and_summon_full_params() -> None:
    want = train_reference(mlp, mlp_data, 3, "sgd")

    def body(g: ProcessGroup) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, np.ndarray, np.ndarray]:
        trained = train_fsdp(g, mlp, mlp_data, "sgd", g.rank, 3, group=g).params
        fresh = FSDP(mlp(7), group=g, wrap=lambda m: isinstance(m, nn.Linear), sync_module_states=False)
        fresh.load_state_dict(trained)
        reloaded = dict(fresh.state_dict())
        only0 = len(fresh.full_state_dict(rank0_only=True))
        x = mlp_data(99, 5)[0]
        out = fresh(x)
        with fresh.summon_full_params():
            first = fresh.module._modules["0"].weight.data
            seen = first.copy()
            first += 1.0
        edited = fresh.full_state_dict()["0.weight"]
        return reloaded, trained, only0, out, np.stack([seen, edited])

    plain = mlp(0)
    plain.load_state_dict(want.params)
    x = mlp_data(99, 5)[0]
    for rank, (reloaded, trained, only0, out, (seen, edited)) in enumerate(run_ranks(3, body)):
        assert_params_close(trained, want.params)
        assert_params_close(reloaded, want.params)
        assert only0 == (len(want.params) if rank == 0 else 0)
        np.testing.assert_allclose(out, plain(x), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(seen, want.params["0.weight"], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(edited, want.params["0.weight"] + 1.0, rtol=TOL, atol=TOL)


def test_errors_say_what_to_do() -> None:
    def body(g: ProcessGroup) -> list[str]:
        messages = []
        meshes = [DeviceMesh((2,), group=g), DeviceMesh((1, 2), group=g)]
        for kwargs in ({"sharding_strategy": S.HYBRID_SHARD, "group": g},
                       {"sharding_strategy": S.HYBRID_SHARD, "mesh": meshes[0]},
                       {"mesh": meshes[1]},
                       {"wrap": [mlp(1)[0]], "group": g}):
            with pytest.raises(ValueError) as err:
                FSDP(mlp(0), **kwargs)
            messages.append(str(err.value))
        for mesh in meshes:
            mesh.destroy()
        mixed = nn.Sequential(nn.Linear(2, 2, dtype=np.float32), nn.Linear(2, 2, dtype=np.float64))
        with pytest.raises(ValueError, match="mixes parameter dtypes"):
            FSDP(mixed, group=g)
        FSDP(nn.Sequential(nn.Linear(2, 2, dtype=np.float32), nn.Linear(2, 2, dtype=np.float64)), group=g, wrap=lambda m: isinstance(m, nn.Linear))
        model = mlp(0)
        early = SGD(list(model.parameters()), lr=0.1)
        fsdp = FullyShardedDataParallel(model, group=g)
        with pytest.raises(RuntimeError, match="build the optimizer after wrapping"):
            early.zero_grad()
        with pytest.raises(RuntimeError, match="build the optimizer after wrapping"):
            early.step()
        assert all(isinstance(p, FlattenedParameter) for p in early.params)
        assert not any(isinstance(p, FlattenedParameter) for p in fsdp.parameters())
        with pytest.raises(TypeError):
            FSDP(mlp(0), group=g, sharding_strategy="full_shard")  # type: ignore[arg-type]
        return messages

    for messages in run_ranks(2, body):
        assert "HYBRID_SHARD needs mesh=DeviceMesh" in messages[0]
        assert "2 dimensions" in messages[1]
        assert "a 2-d mesh is for HYBRID_SHARD" in messages[2]
        assert "not a submodule" in messages[3]


@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_uses_the_whole_models_norm(world: int) -> None:
    """FSDP.clip_grad_norm_ sums every rank's part of the norm: the total and the clipped gradients equal
    single-process clipping of the full gradient (a per-shard clip would differ at 3 ranks by ~sqrt(3))."""
    x, y = mlp_data(0, world * BATCH)
    ref = mlp(0)
    loss = nn.CrossEntropyLoss()
    loss(ref(x), y)
    ref.backward(loss.backward())
    want_norm = clip_grad_norm_(ref.parameters(), 0.05)
    want = {n: p.grad for n, p in ref.named_parameters()}

    def body(pg: ProcessGroup) -> tuple[float, float, Any]:
        fsdp = FSDP(mlp(0), group=pg)
        lf = nn.CrossEntropyLoss()
        rows = slice(pg.rank * BATCH, (pg.rank + 1) * BATCH)
        lf(fsdp(x[rows]), y[rows])
        fsdp.backward(lf.backward())
        total = fsdp.clip_grad_norm_(0.05)
        clipped = [(u.names, u.layout, u.shard.grad.copy()) for u in fsdp.units]
        return total, fsdp.clip_grad_norm_(0.05), clipped

    results = run_ranks(world, body)
    for total, again, _ in results:
        assert total == pytest.approx(want_norm, rel=1e-12)
        assert again == pytest.approx(0.05, rel=1e-4)  # already clipped: the norm is now max_norm
    assert want_norm > 0.05 * 2
    assert_grads_close([Run({}, [], grads) for _, _, grads in results], want)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.SHARD_GRAD_OP])
def test_prefetch_changes_no_number(strategy: ShardingStrategy) -> None:
    """Prefetching moves only the waits, not the arithmetic: the same parameters bit for bit as without it."""

    def body(g: ProcessGroup) -> dict[bool, Run]:
        return {on: train_fsdp(g, TinyLM, lm_data, "adamw", g.rank, 3, group=g, sharding_strategy=strategy,
                               wrap=lambda m: isinstance(m, nn.Linear), forward_prefetch=on, backward_prefetch=on)
                for on in (False, True)}

    for runs in run_ranks(3, body):
        for k, v in runs[False].params.items():
            np.testing.assert_array_equal(runs[True].params[k], v, err_msg=k)


def _wait_done(work: Any, seconds: float = 5.0) -> bool:
    """Poll `work` while this thread (the compute) stands still: True once the comm thread completed it."""
    for _ in range(int(seconds / 0.01)):
        if work is not None and work.is_completed():
            return True
        threading.Event().wait(0.01)
    return False


def test_the_next_units_gather_and_the_last_units_reduce_run_while_this_unit_computes() -> None:
    """FULL_SHARD, a unit per Linear (model[0], [2], [5]): from the second step on, unit k+1's all_gather is issued before
    unit k computes and completes while unit k's forward is held; in backward, the reduce-scatter of the
    unit whose backward just ended completes while the next unit's backward is held, and that unit's
    parameters were prefetched too."""

    def body(g: ProcessGroup) -> list[tuple[str, bool]]:
        model = mlp(0)
        fsdp = FSDP(model, group=g, wrap=lambda m: isinstance(m, nn.Linear), forward_prefetch=True,
                    backward_prefetch=True)
        units = {u.names[0][0].split(".")[0]: u for u in fsdp.units}  # "0.weight" -> the unit of model[0]
        first, second, third = units["0"], units["2"], units["5"]
        seen: list[tuple[str, bool]] = []
        armed = [False]

        def forward_of_first(m: nn.Module, x: np.ndarray, out: np.ndarray) -> None:
            if armed[0]:
                seen.append(("second gathered during first forward", _wait_done(second.pending_gather)))

        def backward_of_second(m: nn.Module, grad_out: np.ndarray) -> None:
            if armed[0]:
                seen.append(("first prefetched during second backward", first.pending_gather is not None))
                work = third.pending_reduce[0] if third.pending_reduce else None
                seen.append(("third reduced during second backward", _wait_done(work)))

        model[0].register_forward_hook(forward_of_first)
        model[2].register_backward_pre_hook(backward_of_second)
        opt = AdamW(list(fsdp.parameters()))
        for step in range(2):
            armed[0] = step == 1
            x, _ = mlp_data(step, 4)
            fsdp.backward(_loss_grad(fsdp(x)))
            opt.step()
            fsdp.zero_grad()
        assert fsdp.memory_stats()["gathered"] == 0 and fsdp.memory_stats()["full_gradients"] == 0
        return seen

    for seen in run_ranks(2, body):
        assert seen == [("second gathered during first forward", True), ("first prefetched during second backward", True),
                        ("third reduced during second backward", True)], seen


@pytest.mark.parametrize("caught_at", ["step", "forward"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_backward_that_bypasses_fsdp_raises_on_every_rank(caught_at: str, prefetch: bool) -> None:
    """The inner model's backward instead of fsdp.backward: the next step (before it changes a shard) or
    forward raises on every rank; eval forwards and no_sync accumulation before it did not trip the check."""
    def body(g: ProcessGroup) -> str:
        model = mlp(0)
        fsdp = FSDP(model, group=g, wrap=lambda m: isinstance(m, nn.Linear), backward_prefetch=prefetch)
        opt = SGD(list(fsdp.parameters()), lr=0.1)
        loss = nn.CrossEntropyLoss()
        x, y = mlp_data(g.rank, BATCH)
        fsdp.eval()
        fsdp(x)
        fsdp.train()
        with fsdp.no_sync():
            loss(fsdp(x), y)
            fsdp.backward(loss.backward())
        loss(fsdp(x), y)
        fsdp.backward(loss.backward())
        opt.step()
        fsdp.zero_grad()
        loss(fsdp(x), y)
        model.backward(loss.backward())
        before = [p.data.copy() for p in fsdp.parameters()]
        with pytest.raises(BypassedBackwardError) as info:
            opt.step() if caught_at == "step" else fsdp(x)
        assert all(np.array_equal(b, p.data) for b, p in zip(before, fsdp.parameters()))
        return str(info.value)

    for message in run_ranks(2, body):
        assert "without fsdp.backward" in message and "Call fsdp.backward(grad) instead of model.backward(grad)" in message
