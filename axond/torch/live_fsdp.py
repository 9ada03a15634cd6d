"""torch FSDP2 (`fully_shard`) over "axond" through a rank's death: `ShardedManager`, `Manager`'s loop for a sharded
model (`axond worker --live-recovery`).

Under FSDP2 each rank holds only its shard of the parameters and of the optimizer state, so a lost rank takes its
shard with it. `ShardedManager` keeps, in every rank's memory, a full copy of the training state as each step begins
(the parameters and the optimizer state gathered, tagged with the steps committed so far; the two newest kept). After
a membership change the survivors re-form torch's default group, agree on the newest copy they all hold, build the
model again (`build_model()`, sharded over a mesh of the new world by `shard`, `fully_shard` by default), load the
copy into it and into a new optimizer (`build_optimizer(params)`), and run on from that step: a step some rank had
committed after the copy runs again from the same state, so every step's update is in the parameters once.

The copies cost one gather of the whole state per step and the whole state's memory on every rank (what FSDP saves
is given back while the copy is kept): a first version, correct, not yet the buddy copies of shards that ZeRO-1 has
(`axond.train.buddy`). Use `manager.model` and `manager.optimizer` anew in every step: both are new objects after a
re-formation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from axond.errors import DistributedError
from axond.torch.join import rows, transfer
from axond.torch.live import Manager

__all__ = ["ShardedManager"]

FULL = StateDictOptions(full_state_dict=True)


def _default_shard(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(module, mesh=mesh)


class ShardedManager(Manager):
    """`Manager` for FSDP2: `build_model()` makes the (unsharded) module, `shard(module, mesh)` shards it in place
    (default: `fully_shard(module, mesh=mesh)`; call `fully_shard` on submodules first there for per-layer units),
    `build_optimizer(params)` makes its optimizer. Both are called again after each re-formation."""

    def __init__(self, build_model: Callable[[], torch.nn.Module],
                 build_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer], *,
                 shard: Callable[[torch.nn.Module, DeviceMesh], None] | None = None, virtual_ranks: int | None = None,
                 seed: int | None = None, apply_step: Callable[[], Any] | None = None) -> None:
        self._build_model, self._build_optimizer = build_model, build_optimizer
        self._shard = shard or _default_shard
        self._copies: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        """Full training states by the steps committed when they were taken (the two newest)."""
        module = build_model()
        self._shard(module, init_device_mesh("cpu", (dist.get_world_size(),)))
        super().__init__(module, build_optimizer(module.parameters()), virtual_ranks=virtual_ranks, seed=seed,
                         apply_step=apply_step)

    def _wrap(self) -> torch.nn.Module:
        return self.module  # sharded in place (after a re-formation: a new module on the new world, the copy loaded)

    def _passes(self, block: range) -> int:
        """As many passes on every rank (FSDP2 gathers the parameters in every forward and backward): the largest
        block; a rank that carries fewer virtual ranks runs its last one again, its gradient counted as zero."""
        return -(-self.virtual // dist.get_world_size())

    def _set_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(sync)  # type: ignore[operator]

    def _before_step(self) -> None:
        """Keep a full copy of the state as this step begins (a collective: every rank gathers every shard)."""
        if self._committed in self._copies:
            return
        model = {k: v.detach().clone() for k, v in get_model_state_dict(self.module, options=FULL).items()}
        optim = copy.deepcopy(get_optimizer_state_dict(self.module, self.optimizer, options=FULL))
        self._copies[self._committed] = (model, optim)
        for tag in sorted(self._copies)[:-2]:
            del self._copies[tag]

    def _restored_from(self) -> int | None:
        return self._committed

    def _drop(self) -> None:
        self._wrapped = None

    def _copy_tags(self) -> tuple[int, int]:
        held = sorted(self._copies)
        return (held[-1], held[0]) if held else (-1, -1)

    def _receive_into(self) -> dict[str, Any] | None:
        return None  # a joining rank holds no copy: the received one is allocated once

    def _take(self, state: dict[str, Any]) -> None:
        """A joining rank keeps the copy received from a live peer (the model is built from it next)."""
        self._copies = {int(state["step"]): (state["model"], state["optimizer"])}
        self._committed = int(state["step"])

    def _join(self) -> None:
        """As in `Manager`; then, when the state came, build the model from the copy as the running ranks do."""
        super()._join()
        if self.transfers:
            self._rebuild(self._committed)

    def _agree(self) -> bool:
        """Agree on the newest copy every running rank holds, send it to ranks that joined, build the model and
        optimizer again from it (every rank)."""
        agreed = rows(self, fresh=False)
        running = [r for r, row in enumerate(agreed) if not row[2]]
        tag = min(agreed[r][4] for r in running)
        if tag < 0 or any(agreed[r][5] > tag for r in running) or tag not in self._copies:
            raise DistributedError(f"live recovery cannot go on: no copy of the training state is held by every "
                                   f"survivor (newest and oldest per rank: {[row[4:] for row in agreed]}); the job "
                                   "must restart from a checkpoint", op="reform")
        self._committed, self._pending = tag, False
        joined = tuple(r for r, row in enumerate(agreed) if row[2])
        if joined:  # ranks that started in this generation take the copy from the lowest running rank
            model_state, optim_state = self._copies[tag]
            self._resize(agreed[running[0]][3])
            self.transfers.append(transfer(self, running[0], joined, {"step": tag, "model": model_state,
                                                                      "optimizer": optim_state}))
        self._rebuild(tag)
        return False

    def _rebuild(self, tag: int) -> None:
        """The model sharded over the current world and a new optimizer, both loaded from the copy `tag`
        (collective)."""
        model_state, optim_state = self._copies[tag]
        module = self._build_model()
        self._shard(module, init_device_mesh("cpu", (dist.get_world_size(),)))
        set_model_state_dict(module, model_state, options=FULL)
        optimizer = self._build_optimizer(module.parameters())
        set_optimizer_state_dict(module, optimizer, copy.deepcopy(optim_state), options=FULL)
        self.module, self.optimizer = module, optimizer
        self._committed = tag
        self._copies = {tag: (model_state, optim_state)}
        self.loss = None
