"""A live job's replica check: the last state the replicas agreed on, kept in memory, and a diverged replica's node
left out (`DistributedTrainer(digest_every=N)` on virtual ranks).

After every N-th step the ranks compare digests of their parameters (`ReplicaCheck`). When every replica agrees,
each rank copies its state (parameters, optimizer state, position, the epoch's loss totals) into buffers of its own
memory: the last agreed state (one more copy of the parameters and the optimizer state per rank). When a strict
majority agrees and some ranks differ (a flipped bit, a bad core), the differing ranks raise `ReplicaDivergence`:
their processes exit, their worker reports the failure, and the job goes on without their node (live recovery).
Every other rank restores the last agreed state; its next collective raises `MembershipChanged` once that node is
gone, and training goes on from the agreed step at the smaller world size. Virtual ranks make that replay compute
what a run without the fault computes, bit for bit. With no strict majority (every rank is named then), or no
agreed state yet, every rank raises, as without live recovery.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from axond.errors import ReplicaDivergence
from axond.nn.device import array_module
from axond.train.resume import Position

if TYPE_CHECKING:
    from axond.train.agree import ReplicaCheck
    from axond.train.trainer import DistributedTrainer


class AgreedState:
    """The last agreed state of one rank of a live job (module docstring); `check` runs the comparison."""

    def __init__(self, trainer: DistributedTrainer, replicas: ReplicaCheck) -> None:
        self.trainer, self.replicas = trainer, replicas
        self.params = list(trainer.module.parameters())
        self._params: list[Any] = []
        self._optimizer: dict[str, Any] | None = None
        self._position: Position | None = None
        self._totals: np.ndarray | None = None
        self.restored: list[tuple[int, int]] = []
        """(step the divergence was seen at, step restored to), oldest first."""

    @property
    def step(self) -> int | None:
        """The global step of the last agreed state (None: none kept yet)."""
        return None if self._position is None else self._position.global_step

    def due(self, step: int) -> bool:
        return self.replicas.due(step)

    def check(self, totals: np.ndarray) -> bool:
        """Collective over the trainer's current group: compare the replicas after the current step. True when this
        rank restored the last agreed state (some other rank diverged and is leaving); False when all agree (the
        state is kept). Raises `ReplicaDivergence` on the diverged ranks, and on every rank when there is no strict
        majority or no agreed state to go back to."""
        t = self.trainer
        self.replicas.group, self.replicas.comm = t.group, t.comm  # the group of this generation
        step = t.position.global_step
        error = self.replicas.check(step)
        if error is None:
            self._keep(totals)
            return False
        majority = len(error.ranks) * 2 < t.group.size
        if majority and self._position is None:
            raise ReplicaDivergence(f"{error.args[0]}; no agreed state in memory to go on from (none is kept before "
                                    "the first check passes)", ranks=error.ranks, hosts=error.hosts, step=step,
                                    group=t.group.name, rank=t.group.rank) from None
        if not majority or t.group.rank in error.ranks:
            raise error
        if t.rank == 0 and t.progress_enabled:
            print(f"{error.args[0]}; the job goes on without it from the agreed state of step {self.step}",
                  flush=True)
        self._restore(totals)
        self.restored.append((step, t.position.global_step))
        return True

    def _keep(self, totals: np.ndarray) -> None:
        t = self.trainer
        if len(self._params) != len(self.params):
            self._params = [array_module(p.data).empty_like(p.data) for p in self.params]
        for kept, p in zip(self._params, self.params):
            kept[...] = p.data
        state = t.optimizer.state_dict()
        old = self._optimizer["state"] if self._optimizer is not None else {}
        arrays: dict[str, Any] = {}
        for key, value in state["state"].items():
            if not hasattr(value, "shape"):
                arrays[key] = value
                continue
            kept = old.get(key)
            if kept is None or getattr(kept, "shape", None) != value.shape or kept.dtype != value.dtype:
                kept = array_module(value).empty_like(value)
            kept[...] = value
            arrays[key] = kept
        self._optimizer = {"defaults": dict(state["defaults"]), "state": arrays}
        pos = t.position
        self._position = replace(pos, history=[dict(h) for h in pos.history])
        if self._totals is None or self._totals.shape != totals.shape:
            self._totals = np.empty_like(totals)
        self._totals[...] = totals

    def _restore(self, totals: np.ndarray) -> None:
        t = self.trainer
        assert self._optimizer is not None and self._position is not None and self._totals is not None
        for kept, p in zip(self._params, self.params):
            p.data[...] = kept
        t.optimizer.load_state_dict(self._optimizer)
        kept_pos = self._position
        t.position.epoch, t.position.step, t.position.global_step = kept_pos.epoch, kept_pos.step, kept_pos.global_step
        t.position.history[:] = [dict(h) for h in kept_pos.history]
        totals[...] = self._totals
