"""`Pipeline`: a Sequential cut into stages over a group's ranks, trained with a microbatch schedule.

Every rank builds the same model (same seed) and wraps it; rank r keeps stage r (or stages r,
r + P, ... with INTERLEAVED_1F1B) and drops the rest. `step(x, y)` splits the batch into M
microbatches, runs this rank's schedule (see `schedules`), and accumulates this rank's parameter
gradients so that they equal single-process training on the whole batch with a mean loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError
from axond.nn.container import Sequential
from axond.nn.device import Array, array_module
from axond.nn.module import Module, Parameter
from axond.parallel.pipeline.p2p import StageLinks, incoming_order
from axond.parallel.pipeline.schedules import Action, PipelineSchedule, rank_actions, stage_rank, validate
from axond.parallel.pipeline.split import split_sequential
from axond.distributed import default_registry as defaults
from axond.parallel.optimizer_state import optimizer_state_bytes


class LossFn(Protocol):
    """An axond loss: calling it returns the loss, `backward(scale)` returns d (scale * loss) / d prediction."""

    def __call__(self, pred: Array, target: Array, /) -> float: ...

    def backward(self, scale: float = 1.0) -> Array: ...


def _default_group() -> ProcessGroup:
    return defaults.require("Pipeline")


class Pipeline:
    """Pipeline-parallel training of a model cut into `group.size * virtual_stages` stages.

    `model` is an `axond.nn.Sequential` (cut at `split_points`, the first layer index of each later
    stage, or balanced by parameter count) or the list of all stage modules, identical on every rank.
    The loss is the row-weighted mean over microbatches of `loss_fn` (the whole batch's mean loss
    for per-row mean losses such as MSELoss and CrossEntropyLoss without ignored targets).
    """

    def __init__(self, model: Sequential | Sequence[Module], group: ProcessGroup | None = None, *,
                 schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B, num_microbatches: int = 1,
                 loss_fn: LossFn | None = None, virtual_stages: int = 1,
                 split_points: Sequence[int] | None = None) -> None:
        self.group = group if group is not None else _default_group()
        size, rank = self.group.size, self.group.rank
        validate(schedule, size, num_microbatches, virtual_stages)
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.virtual_stages = virtual_stages
        self.num_stages = size * virtual_stages
        self.loss_fn = loss_fn
        stages = self._stages_of(model, split_points)
        self.stage_ids = [c * size + rank for c in range(virtual_stages)]
        """Global indices of this rank's stages, by local chunk."""
        self.stages: list[Module] = [stages[s] for s in self.stage_ids]
        lists = [rank_actions(schedule, r, size, num_microbatches, virtual_stages) for r in range(size)]
        self.actions: list[Action] = lists[rank]
        """This rank's schedule."""
        self._incoming = incoming_order(lists, rank, self.num_stages)
        forwards = [[a for a in acts if a.kind == "F"] for acts in lists]
        self._forward_actions = forwards[rank]
        self._forward_incoming = incoming_order(forwards, rank, self.num_stages)
        self.peak_stashed = 0
        """Most microbatch activations (forward caches) this rank held at once during the last `step`."""

    def _stages_of(self, model: Sequential | Sequence[Module], split_points: Sequence[int] | None) -> list[Module]:
        if isinstance(model, Sequential):
            return list(split_sequential(model, self.num_stages, split_points))
        if isinstance(model, Module):
            raise TypeError(f"Pipeline takes an axond.nn.Sequential or a list of stage modules, got a "
                            f"{type(model).__name__}; wrap its layers in a Sequential")
        stages = list(model)
        if split_points is not None:
            raise ValueError("split_points only applies when Pipeline splits a Sequential; got a list of stages")
        if len(stages) != self.num_stages:
            raise ValueError(f"{self.group.size} ranks x {self.virtual_stages} virtual stages need "
                             f"{self.num_stages} stage modules, got {len(stages)}")
        for i, s in enumerate(stages):
            if not isinstance(s, Module):
                raise TypeError(f"stage {i} is a {type(s).__name__}, not an axond.nn.Module")
        return stages

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (it needs the inputs)."""
        return self.group.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it needs the targets and computes the loss)."""
        return self.group.rank == stage_rank(self.num_stages - 1, self.group.size)

    def step(self, x: Array | None, y: Array | None) -> float:
        """One forward and backward of the batch (x, y) through the pipeline; returns its loss on every rank.

        `x` is needed on the first rank and `y` on the last (others may pass None). Gradients are
        added into this rank's parameters' `.grad` (zero them first, as in single-process training).
        The loss is computed on the last stage and broadcast over the group, so every rank must call
        `step`. After a failure the group's point-to-point streams may hold unread messages: build
        a new group (and Pipeline) rather than stepping again.
        """
        if self.loss_fn is None:
            raise ValueError("Pipeline.step needs loss_fn=... at construction; forward() works without one")
        loss_fn = self.loss_fn
        xs, _ = self._split(x, "x") if self.is_first else ([], [])
        ys, weights = self._split(y, "y") if self.is_last else ([], [])
        links = StageLinks(self.group, self._incoming, self._xp())
        stash: dict[tuple[int, int], list[Any]] = {}
        loss_grads: dict[int, Array] = {}
        total = 0.0
        self.peak_stashed = 0
        size, last = self.group.size, self.num_stages - 1
        try:
            for a in self.actions:
                stage, module, m = self.stage_ids[a.chunk], self.stages[a.chunk], a.microbatch
                if a.kind == "F":
                    inp = xs[m] if stage == 0 else links.recv_activation(m, stage, stage_rank(stage - 1, size))
                    out = module(inp)
                    stash[(m, a.chunk)] = module.save_context()
                    self.peak_stashed = max(self.peak_stashed, len(stash))
                    if stage == last:
                        total += weights[m] * float(loss_fn(out, ys[m]))
                        loss_grads[m] = loss_fn.backward(weights[m])
                    else:
                        links.send_activation(out, m, stage + 1, stage_rank(stage + 1, size))
                    continue
                g = loss_grads.pop(m) if stage == last else links.recv_grad(m, stage, stage_rank(stage + 1, size))
                module.restore_context(stash.pop((m, a.chunk)))
                grad_in = module.backward(g)
                if stage > 0:
                    if grad_in is None:
                        raise ValueError(f"stage {stage} returned no input gradient (does it start with an "
                                         f"Embedding?); only stage 0 may take non-differentiable inputs")
                    links.send_grad(grad_in, m, stage - 1, stage_rank(stage - 1, size))
            links.wait_sends()
        except Exception as e:
            self._abort(e)
            raise
        finally:
            stash.clear()
        return self._broadcast_loss(total)

    def forward(self, x: Array | None) -> Array | None:
        """Inference: run the batch through every stage (no backward, nothing stashed).

        Returns the model output on the last stage's rank and None elsewhere; `x` is needed on the first rank.
        """
        xs, _ = self._split(x, "x") if self.is_first else ([], [])
        links = StageLinks(self.group, self._forward_incoming, self._xp())
        outs: dict[int, Array] = {}
        size, last = self.group.size, self.num_stages - 1
        try:
            for a in self._forward_actions:
                stage, module, m = self.stage_ids[a.chunk], self.stages[a.chunk], a.microbatch
                inp = xs[m] if stage == 0 else links.recv_activation(m, stage, stage_rank(stage - 1, size))
                out = module(inp)
                module.save_context()
                if stage == last:
                    outs[m] = out
                else:
                    links.send_activation(out, m, stage + 1, stage_rank(stage + 1, size))
            links.wait_sends()
        except Exception as e:
            self._abort(e)
            raise
        if not self.is_last:
            return None
        first = outs[0]
        return array_module(first).concatenate([outs[m] for m in range(self.num_microbatches)], axis=0)

    def _abort(self, error: Exception) -> None:
        """A stage of this rank failed on its own: abort the group so the other stages raise now, not at their timeout."""
        if not isinstance(error, DistributedError):
            self.group.abort(f"pipeline stage(s) {self.stage_ids} on group rank {self.group.rank} failed: "
                             f"{type(error).__name__}: {error}")

    def _split(self, batch: Array | None, name: str) -> tuple[list[Array], list[float]]:
        """The batch's M microbatches (views along axis 0, sizes differing by at most one) and row weights."""
        role = "first" if name == "x" else "last"
        if batch is None:
            raise ValueError(f"group rank {self.group.rank} holds the {role} pipeline stage, so step/forward "
                             f"needs {name} there (got None)")
        rows = int(batch.shape[0]) if batch.ndim else 0
        if rows < self.num_microbatches:
            raise ValueError(f"{name} has {rows} rows, fewer than num_microbatches={self.num_microbatches}; "
                             f"use a larger batch or fewer microbatches")
        parts = array_module(batch).array_split(batch, self.num_microbatches, axis=0)
        return list(parts), [int(p.shape[0]) / rows for p in parts]

    def _broadcast_loss(self, total: float) -> float:
        if self.group.size == 1:
            return total
        buf = np.array([total], np.float64)
        self.group.broadcast(buf, src=stage_rank(self.num_stages - 1, self.group.size))
        return float(buf[0])

    def _xp(self) -> Any:
        for p in self.parameters():
            return array_module(p.data)
        return np

    def parameters(self) -> Iterator[Parameter]:
        """This rank's parameters (hand them to an optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """This rank's parameters under their names in the unsplit model (for a split Sequential)."""
        for stage in self.stages:
            yield from stage.named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this rank's stages."""
        for stage in self.stages:
            stage.zero_grad(set_to_none)

    def memory_stats(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank's stages hold: parameters, gradients, optimizer_state (0 without `optimizer`), current.

        Activations stashed between a microbatch's forward and backward are not counted (`peak_stashed`
        gives how many were alive at once)."""
        params = list(self.parameters())
        stats = {
            "parameters": sum(int(p.data.nbytes) for p in params),
            "gradients": sum(int(p.grad.nbytes) for p in params if p.grad is not None),
            "optimizer_state": optimizer_state_bytes(optimizer),
        }
        stats["current"] = sum(stats.values())
        return stats

    def train(self, mode: bool = True) -> Pipeline:
        """Set training mode on this rank's stages."""
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> Pipeline:
        """Set evaluation mode on this rank's stages."""
        return self.train(False)

    def __repr__(self) -> str:
        return (f"Pipeline({self.schedule.name}, rank {self.group.rank}/{self.group.size}, stages {self.stage_ids}"
                f" of {self.num_stages}, microbatches={self.num_microbatches})")
