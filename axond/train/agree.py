"""The trainer's replica check (`DistributedTrainer(digest_every=N)`): a digest of the parameters every N optimizer
steps (`axond.train.digest`), and which checkpoints are "agreed": saved at or before a step whose check passed.

On a mismatch the trainer rolls every rank back to the newest agreed checkpoint (newer ones, which may hold the
diverged weights, are removed) and warns naming the rank(s) and host(s); with no agreed checkpoint, or after
`MAX_ROLLBACKS` rollbacks in one `fit`, it raises `ReplicaDivergence` on every rank.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from axond.checkpoint.api import ObjectCollectives
from axond.checkpoint.storage import complete_checkpoints
from axond.distributed.process_group import ProcessGroup
from axond.errors import ReplicaDivergence, rank_list
from axond.train.digest import check_replicas

MAX_ROLLBACKS = 3
"""Rollbacks one `fit` makes before it raises: a replica that diverges again and again is a node to leave out."""
COMPARABLE = ("ddp", "zero")
"""Parallel modes whose ranks hold replicated parameters after each step (FSDP, tp and pipeline ranks hold shards)."""
LEAVE_OUT = ("its node is likely faulty (silent data corruption): restart the job without that node and check its "
             "memory and accelerator")


class ReplicaCheck:
    """Digests every `every` steps over `group`; remembers the checkpoints this run saved and which are agreed."""

    def __init__(self, every: int, params: Sequence[Any], group: ProcessGroup, comm: ObjectCollectives) -> None:
        self.every, self.params, self.group, self.comm = every, list(params), group, comm
        self.verified = -1
        """The last global step a check passed at."""
        self.saved: list[tuple[int, str]] = []
        """(step, path) of the checkpoints this run saved, oldest first."""
        self.rollbacks = 0
        self.divergences: list[ReplicaDivergence] = []
        """Every divergence seen (rolled back from or raised), oldest first."""

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(self, step: int) -> ReplicaDivergence | None:
        """Collective: None when every replica agrees (the step is then verified), else the error naming the ranks."""
        ranks = check_replicas(self.params, self.group)
        if not ranks:
            self.verified = step
            return None
        hosts: list[str] = self.comm.all_gather(socket.gethostname())
        named = [hosts[r] for r in ranks]
        where = ", ".join(f"rank {r} on {h}" for r, h in list(zip(ranks, named))[:8])
        agree = self.group.size - len(ranks) if len(ranks) < self.group.size else 0
        majority = f"{agree} of {self.group.size} ranks agree" if agree else "no majority: every rank is named"
        error = ReplicaDivergence(
            f"replicas disagree after step {step} in group {self.group.name!r}: the parameters of group rank(s) "
            f"{rank_list(ranks)} ({where}) differ from the majority's ({majority}); {LEAVE_OUT}",
            ranks=ranks, hosts=named, step=step, group=self.group.name, rank=self.group.rank)
        self.divergences.append(error)
        return error

    def saved_at(self, step: int, path: str) -> None:
        self.saved.append((step, path))

    def agreed(self) -> tuple[int, str] | None:
        """The newest checkpoint saved at or before the last verified step, if it is still on disk."""
        for step, path in reversed(self.saved):
            if step <= self.verified and Path(path).is_dir():
                return step, path
        return None

    def rolled_back(self, step: int) -> None:
        """Forget the checkpoints after `step` (removed) and count the rollback."""
        self.saved = [(s, p) for s, p in self.saved if s <= step]
        self.verified = step
        self.rollbacks += 1


def remove_newer(directory: Path, step: int) -> None:
    """Remove the complete checkpoints in `directory` saved after global step `step` (named step_NNNNNNNNN)."""
    for _, name, path in complete_checkpoints(directory):
        if name.startswith("step_") and name.removeprefix("step_").isdigit() and int(name.removeprefix("step_")) > step:
            shutil.rmtree(path, ignore_errors=True)
