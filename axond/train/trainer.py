"""`DistributedTrainer`: data-parallel (DDP, ZeRO-1, FSDP), tensor- or pipeline-parallel training with
checkpoints and exact resume.

Each optimizer step takes `grad_accum_steps` micro-batches of `batch_size` samples per rank from
the rank's `DistributedSampler` shard (reshuffled per epoch), so the global batch is
`batch_size * world_size * grad_accum_steps` (under "tp" and "pipeline" the ranks split the model,
not the data: all read the same batches). Every `checkpoint_every` steps the model, optimizer
and position (epoch, step in epoch, random states, running sums) are saved with `axond.checkpoint`;
`fit` starts from the newest complete checkpoint, skipping the batches already trained on, so a run
killed at any step and restarted ends with the parameters of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import axond.checkpoint as ckpt
from axond.checkpoint.api import ObjectCollectives
from axond.distributed.process_group import ProcessGroup
from axond.nn.module import Module
from axond.nn.optim import Optimizer
from axond.nn.utils import clip_grad_norm_
from axond.nn.container import Sequential
from axond.parallel import DDP, FSDP, DistributedSampler, Pipeline, ShardingStrategy, ZeroRedundancyOptimizer
from axond.parallel.fsdp.virtual import VirtualFSDP
from axond.parallel.zero.virtual import VirtualZero
from axond.train.agree import COMPARABLE, ReplicaCheck
from axond.train.checkpointing import TrainerCheckpoints
from axond.train.clip import clip_partitioned, tensor_parallel_split
from axond.train.data import Dataset
from axond.train.guard import GUARDS
from axond.train.live import VirtualSteps
from axond.train.progress import Progress
from axond.train.resume import Position, capture_rank_state, restore_rank_state
from axond.train.steps import Steps
from axond.distributed import default_registry as defaults
from axond.distributed import membership

PARALLEL = ("ddp", "zero", "fsdp", "tp", "pipeline", "none")
VIRTUAL = ("ddp", "zero", "fsdp")
"""Parallel modes that train on virtual ranks (and so recover live)."""


class Callback:
    """Hooks called on every rank (override any); `metrics` dicts may be extended for the epoch line."""

    def on_fit_start(self, trainer: DistributedTrainer) -> None: ...

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None: ...

    def on_epoch_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, trainer: DistributedTrainer, path: str) -> None: ...

    def on_fit_end(self, trainer: DistributedTrainer, history: list[dict[str, float]]) -> None: ...


def _default_group() -> ProcessGroup:
    return defaults.require("DistributedTrainer")


class DistributedTrainer:
    """Train `model` with `optimizer_factory(params)` on `dataset` over `group` (see the module docstring).

    model: an unwrapped `axond.nn.Module`, identical on every rank; wrapped here per `parallel`
    ("ddp", "zero": DDP + ZeroRedundancyOptimizer, "fsdp" with `sharding`, "tp": a model built from
    tensor-parallel layers over `group`, used as is, "pipeline": a Sequential cut into stages over
    `group`, "none": one process), with `wrapper_options` passed to DDP/FSDP/Pipeline (e.g. num_microbatches). optimizer_factory: params -> optimizer (given FSDP's
    shards under "fsdp"). loss_fn: an axond loss (call -> loss, `backward()` -> d loss / d output).
    dataset / eval_dataset: `(X, y)` or an object with `__len__` and `__getitem__(indices) -> (x, y)`.
    batch_size: samples per rank per micro-batch; grad_accum_steps micro-batches make one step.
    clip_norm: clip the global gradient norm. checkpoint_dir / checkpoint_every (optimizer steps) /
    keep_checkpoints / async_checkpoint: see `save_checkpoint`. checkpoint_guard: "warn" (default), "error" or
    "off" when ranks see different checkpoint directories, or a restarted generation finds no checkpoint where
    the job saved one (`axond.train.guard`). group: default: the initialised world.
    digest_every: compare a digest of the parameters across the replicas every N optimizer steps ("ddp", "zero");
    on a mismatch roll back to the newest agreed checkpoint or raise `ReplicaDivergence` (`axond.train.agree`); with
    virtual ranks (a live job, "ddp"), the diverged ranks raise, their node leaves, and the others go on from the last
    agreed state kept in memory (`axond.train.agreed`).
    virtual_ranks: ("ddp", "zero", "fsdp") train on this many virtual data-parallel ranks, each with its data shard and random
    stream,
    their gradients summed in a fixed order, so that the parameters do not depend on the world size
    (`axond.train.live`); default, when the job recovers live (`axond worker --live-recovery`): the most ranks it may
    grow to (`--nnodes` MAX x `--nproc-per-node`), at least the group's size, where
    a `MembershipChanged` is then caught, the group re-formed and the cut step run again; else off. deterministic:
    with virtual ranks, sum the gradients in virtual-rank order (bit-identical at every world size; an all_gather),
    or, False, in whatever order an all_reduce sums them (fewer bytes; equal up to float rounding). copy_every:
    ("zero", "fsdp" on virtual ranks: `axond.parallel.fsdp.virtual`) copy each rank's optimizer-state shard to a
    buddy's memory (and its worker daemon's) every N committed steps, the buddy keeping the gradients between
    (`axond.train.buddy`), so that a live job rebuilds a lost rank's shard without storage; None: no buddy copies.
    seed / shuffle: the `DistributedSampler`'s. callbacks: `Callback`s. progress / log_every: rank 0's display.
    """

    def __init__(
        self,
        model: Module,
        optimizer_factory: Callable[[list[Any]], Optimizer],
        loss_fn: Any,
        dataset: Any,
        batch_size: int,
        parallel: str = "ddp",
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        *,
        eval_dataset: Any = None,
        grad_accum_steps: int = 1,
        clip_norm: float | None = None,
        group: ProcessGroup | None = None,
        sharding: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        seed: int = 0,
        shuffle: bool = True,
        callbacks: Sequence[Callback] = (),
        progress: bool = True,
        log_every: int | None = None,
        keep_checkpoints: int | None = 2,
        async_checkpoint: bool = False,
        wrapper_options: dict[str, Any] | None = None,
        checkpoint_guard: str = "warn",
        digest_every: int | None = None,
        virtual_ranks: int | None = None,
        deterministic: bool = True,
        copy_every: int | None = 1,
    ) -> None:
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
        if batch_size < 1 or grad_accum_steps < 1:
            raise ValueError(f"batch_size and grad_accum_steps must be >= 1, got {batch_size} and {grad_accum_steps}")
        if checkpoint_every is not None and (checkpoint_every < 1 or checkpoint_dir is None):
            raise ValueError("checkpoint_every needs checkpoint_dir= and must be >= 1 (optimizer steps)")
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None (keep all), got {keep_checkpoints}")
        if checkpoint_guard not in GUARDS:
            raise ValueError(f"checkpoint_guard must be one of {GUARDS}, got {checkpoint_guard!r}")
        if digest_every is not None and (digest_every < 1 or parallel not in COMPARABLE):
            raise ValueError(f"digest_every must be >= 1 and needs replicated parameters (parallel in {COMPARABLE}), got "
                             f"{digest_every} with parallel={parallel!r}: FSDP, tp and pipeline ranks hold shards")
        self.group = group if group is not None else _default_group()
        live = membership.current()
        if virtual_ranks is None and parallel in VIRTUAL and live is not None:
            # a live job: the math must not change when a node leaves, nor when it grows to its MAX (a replacement
            # joining a smaller world builds the same virtual ranks and ZeRO-1 shards as the running ranks)
            virtual_ranks = max(self.group.size, live.max_world)
        if virtual_ranks is not None and (parallel not in VIRTUAL or eval_dataset is not None
                                          or (digest_every is not None and parallel != "ddp")):
            raise ValueError(f"virtual_ranks ({virtual_ranks}) works with parallel in {VIRTUAL} without eval_dataset "
                             f"(and with digest_every under 'ddp' only) so far; got parallel={parallel!r}")
        if copy_every is not None and copy_every < 1:
            raise ValueError(f"copy_every must be >= 1 (committed steps between buddy copies) or None, got {copy_every}")
        self.comm = ObjectCollectives(self.group)
        self.rank, self.world_size = self.group.rank, self.group.size
        self.dataset = Dataset(dataset)
        self.eval_dataset = Dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        self.grad_accum_steps = grad_accum_steps
        self.clip_norm = clip_norm
        self.parallel = parallel
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.async_checkpoint = async_checkpoint
        self.checkpoints = TrainerCheckpoints(self, checkpoint_guard)
        """Saving, pruning, resuming and rolling back this trainer's checkpoints (`axond.train.checkpointing`)."""
        self.callbacks = list(callbacks)
        self.progress_enabled = progress
        self.log_every = log_every
        self.module = model
        self._wrapper_options = dict(wrapper_options or {})
        self._virtual_ranks = virtual_ranks
        self.model, self.optimizer, self._clip = self._wrap(model, optimizer_factory, sharding)
        self.data_replicas = 1 if parallel in ("tp", "pipeline") else self.world_size
        """How many ranks read different data (1 when the ranks split the model instead)."""
        replica = self.rank if self.data_replicas > 1 else 0
        self.sampler = DistributedSampler(len(self.dataset), self.data_replicas, replica, shuffle=shuffle, seed=seed)
        self.position = Position()
        self.resumed_from: str | None = None
        """The checkpoint the last `fit` started from (None: from scratch)."""
        self._totals = np.zeros(2, np.float64)
        self.steps = Steps(self)
        """The loop without virtual ranks, and evaluation (`axond.train.steps`)."""
        self.replicas = ReplicaCheck(digest_every, list(model.parameters()), self.group, self.comm) \
            if digest_every else None
        """The replica check (digest_every=), with the divergences it saw; None when off."""
        self.virtual = VirtualSteps(self, virtual_ranks, seed, shuffle, deterministic, copy_every) \
            if virtual_ranks is not None else None
        """The virtual-rank loop (virtual_ranks=, or a live job), with the re-formations it went through."""

    def _wrap(self, model: Module, factory: Callable[[list[Any]], Optimizer],
              sharding: ShardingStrategy | str) -> tuple[Any, Optimizer, Callable[[float], float]]:
        if self.parallel == "fsdp" and self._virtual_ranks is None:
            strategy = sharding if isinstance(sharding, ShardingStrategy) else ShardingStrategy[str(sharding).upper()]
            fsdp = FSDP(model, self.group, sharding_strategy=strategy, **self._wrapper_options)
            return fsdp, factory(list(fsdp.parameters())), fsdp.clip_grad_norm_
        if self.parallel == "tp":
            own, shared = tensor_parallel_split(model)
            return model, factory(list(model.parameters())), lambda m: clip_partitioned(own, shared, self.group, m)
        if self.parallel == "pipeline":
            if not isinstance(model, Sequential):
                raise TypeError(f"parallel='pipeline' needs an axond.nn.Sequential to cut into stages, got {type(model).__name__}")
            pipe = Pipeline(model, self.group, loss_fn=self.loss_fn, **self._wrapper_options)
            params = list(pipe.parameters())
            return pipe, factory(params), lambda m: clip_partitioned(params, [], self.group, m)
        if self._virtual_ranks is not None:  # the virtual-rank loop reduces the gradients itself (axond.train.live)
            params = list(model.parameters())
            opt = factory(params)
            if self.parallel == "zero":  # ZeRO-1 on virtual shards: the layout does not depend on the world size
                opt = VirtualZero(params, type(opt), self.group, self._virtual_ranks, **opt.defaults)
            if self.parallel == "fsdp":  # FSDP on virtual shards: clipped in the reduction (`axond.train.sharded`)
                if self._wrapper_options:
                    raise ValueError(f"parallel='fsdp' on virtual ranks (a live job, or virtual_ranks=) takes no "
                                     f"wrapper_options (got {sorted(self._wrapper_options)}): it shards the whole model "
                                     "as one unit; drop them, or use the FSDP wrapper's options outside a live job")
                opt = VirtualFSDP(params, type(opt), self.group, self._virtual_ranks, **opt.defaults)
                return model, opt, lambda max_norm: self._reduced_norm()
            return model, opt, lambda max_norm: clip_grad_norm_(params, max_norm)
        if self.parallel == "none" and self.world_size > 1:
            raise ValueError(f"parallel='none' trains one process; this group has {self.world_size} ranks")
        wrapped: Any = DDP(model, self.group, **self._wrapper_options) if self.parallel != "none" else model
        params = list(model.parameters())
        opt = factory(params)
        if self.parallel == "zero":
            opt = ZeroRedundancyOptimizer(params, type(opt), self.group, **opt.defaults)
        return wrapped, opt, lambda max_norm: clip_grad_norm_(params, max_norm)

    def _reduced_norm(self) -> float:
        """FSDP on virtual ranks: the gradient norm of the last step, clipped already while it was reduced."""
        assert self.virtual is not None
        return float(getattr(self.virtual.grads, "norm", 0.0))

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint holds: model, optimizer (views, no copies) and the training position."""
        model_sd, optim_sd = ckpt.get_state_dict(self.model, self.optimizer)
        trainer = self.position.to_state()
        trainer[f"rank_{self.rank}"] = capture_rank_state(self.module, self._totals)
        return {"model": model_sd, "optim": optim_sd, "trainer": trainer}

    def save_checkpoint(self) -> str:
        """Save now to `checkpoint_dir/step_NNNNNNNNN` (collective); prunes older ones beyond `keep_checkpoints`."""
        return self.checkpoints.save()

    def resume(self) -> str | None:
        """Load the newest complete checkpoint in `checkpoint_dir`, if any (collective); returns its path."""
        return self.checkpoints.resume()

    def _load(self, path: str) -> None:
        """Load the checkpoint at `path` into the model, optimizer and position (collective)."""
        model_sd, optim_sd = ckpt.get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        ckpt.load(sd, path, self.group)
        ckpt.set_state_dict(self.model, self.optimizer, sd["model"], sd["optim"])
        meta = ckpt.read_metadata(path)
        self.position = Position.from_objects(meta.objects)
        mine = meta.objects.get(f"trainer/rank_{self.rank}")
        if mine is not None and meta.world_size == self.world_size:
            restore_rank_state(self.module, mine, self._totals)
        else:
            self._totals[:] = 0.0

    def evaluate(self) -> float:
        """Mean loss over `eval_dataset` (every rank evaluates its shard; collective)."""
        return self.steps.evaluate()

    def fit(self, epochs: int) -> list[dict[str, float]]:
        """Train until `epochs` epochs are done (resuming first); returns the per-epoch history."""
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        joined = self.virtual is not None and self.virtual.join_running()  # a live job's new rank: state from a peer
        self.resumed_from = None if joined else self.resume()
        pos = self.position
        if self.replicas is not None:
            self.replicas.rollbacks = 0  # MAX_ROLLBACKS counts per fit
            if self.resumed_from is not None:  # what every replica starts from: agreed once a check passes after it
                self.replicas.saved_at(pos.global_step, self.resumed_from)
        show = self.progress_enabled and self.rank == 0
        progress = Progress(show, epochs, self.log_every)
        self._call("on_fit_start")
        begun = (pos.epoch, pos.global_step)
        try:
            run = self.virtual.run_epochs if self.virtual is not None else self.steps.run_epochs
            while not run(epochs, progress):
                pass  # rolled back to the agreed checkpoint: go on from there
            pos = self.position
            if self.checkpoint_dir is not None and (pos.epoch, pos.global_step) != begun:
                self.save_checkpoint()
        finally:
            progress.close()
            self.wait_for_checkpoint()
            self.checkpoints.close()
        self._call("on_fit_end", pos.history)
        return pos.history

    def wait_for_checkpoint(self, timeout: float = 600.0) -> None:
        """Block until the last async checkpoint is committed (re-raises its error)."""
        self.checkpoints.wait(timeout)
