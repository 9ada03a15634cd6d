"""The trainer's straggler check: every N steps the ranks exchange their arrival marks and agree on the stragglers.

Each rank of a group keeps the last marks of how long it waited in the group's collectives
(`axond.distributed.diagnostics.arrivals`). `find_stragglers` gathers them from every member (one all_gather of
`KEEP_MARKS` x 3 int64 per rank, about 1.5 KB) and compares them as the worker does, so every rank gets the same
answer at the same step, with or without `axond worker`. `StragglerCallback` runs it every `every` optimizer steps of a
`DistributedTrainer` and calls `on_straggler(trainer, straggler)` on every rank when a rank is first named (and
`on_recovered(trainer, rank)` when it no longer is): the trainer can act on it alike everywhere (log it, shift
work, checkpoint and stop to leave the node out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from axond.config import StragglerSettings
from axond.distributed.diagnostics.arrivals import KEEP_MARKS, Straggler, stragglers
from axond.distributed.process_group import ProcessGroup
from axond.train.trainer import Callback, DistributedTrainer

__all__ = ["StragglerCallback", "find_stragglers"]


def find_stragglers(group: ProcessGroup, settings: StragglerSettings | None = None) -> list[Straggler]:
    """The members of `group` the others wait for, from every member's marks (collective: call it on every member
    at the same point). `settings`: default AXOND_STRAGGLER_*; with recording off (AXOND_STRAGGLER_WINDOW_OPS=0)
    nobody is named. Ranks in the result are global."""
    settings = settings if settings is not None else group.options.runtime_env().stragglers
    mine = np.full((KEEP_MARKS, 3), -1, np.int64)
    marks = list(group.windows)  # a copy: the group's communication thread may append meanwhile
    if marks:
        mine[: len(marks)] = marks
    every = group.all_gather(mine)
    reports: dict[int, dict[str, Any]] = {}
    for member, rows in enumerate(every):
        kept = rows[rows[:, 0] >= 0]
        reports[group.ranks[member]] = {group.name: {"ops": group.window_ops, "w": kept.tolist()}}
    return stragglers(reports, settings)


class StragglerCallback(Callback):
    """A `DistributedTrainer` callback: every `every` optimizer steps, `find_stragglers` on the trainer's group;
    `on_straggler(trainer, straggler)` for each rank newly named, `on_recovered(trainer, rank)` when one is no
    longer named. `named` holds the ranks named at the last check."""

    def __init__(self, on_straggler: Callable[[DistributedTrainer, Straggler], None], every: int = 10,
                 on_recovered: Callable[[DistributedTrainer, int], None] | None = None,
                 settings: StragglerSettings | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 optimizer steps, got {every}")
        self.on_straggler, self.on_recovered, self.every, self.settings = on_straggler, on_recovered, every, settings
        self.named: dict[int, Straggler] = {}

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        if int(metrics.get("global_step", 0)) % self.every:
            return
        found = {s.rank: s for s in reversed(find_stragglers(trainer.group, self.settings))}
        for rank in sorted(set(found) - set(self.named)):
            self.on_straggler(trainer, found[rank])
        for rank in sorted(set(self.named) - set(found)):
            if self.on_recovered is not None:
                self.on_recovered(trainer, rank)
        self.named = found
