"""The trainer's checkpoint files: save (now or in the background) and prune, resume from the newest complete one,
and roll every rank back to the agreed one when the replicas diverged (`DistributedTrainer`).

What a checkpoint holds, and loading it into the model, optimizer and position, stay with the trainer
(`DistributedTrainer.state_dict`); this module decides where, when and which.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import axond.checkpoint as ckpt
from axond.checkpoint.storage import complete_checkpoints, remove_stale_temps
from axond.train.agree import MAX_ROLLBACKS, remove_newer
from axond.train.guard import CheckpointGuard

if TYPE_CHECKING:
    from axond.train.trainer import DistributedTrainer


class TrainerCheckpoints:
    """The checkpoints of one trainer in its `checkpoint_dir` (read from the trainer at each call); every call that
    touches them is collective."""

    def __init__(self, trainer: DistributedTrainer, guard: str) -> None:
        self.trainer = trainer
        self.guard = CheckpointGuard(guard, trainer.comm, trainer.checkpoint_dir) if trainer.checkpoint_dir else None
        """The restart and shared-directory check (`axond.train.guard`); None without a checkpoint directory."""
        self.pending: Future[str] | None = None
        """The async save in flight, if any."""

    def save(self) -> str:
        """Save now to `checkpoint_dir/step_NNNNNNNNN`; prunes older ones beyond `keep_checkpoints`."""
        t = self.trainer
        if t.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs checkpoint_dir=")
        path = t.checkpoint_dir / f"step_{t.position.global_step:09d}"
        if t.replicas is not None:
            t.replicas.saved_at(t.position.global_step, str(path))
        if t.async_checkpoint:
            self.pending = ckpt.async_save(t.state_dict(), path, t.group)
            if t.rank == 0:
                self.pending.add_done_callback(self._prune_after)
        else:
            ckpt.save(t.state_dict(), path, t.group)
            if t.rank == 0:
                self._committed(str(path))
        t._call("on_checkpoint", str(path))
        return str(path)

    def _prune_after(self, future: Future[str]) -> None:
        if future.exception() is None:
            self._committed(future.result())

    def _committed(self, path: str) -> None:
        """Rank 0, once `path` is committed: prune older checkpoints and tell the job's store (the restart check)."""
        self._prune()
        if self.guard is not None:
            self.guard.saved(int(Path(path).name.removeprefix("step_")), path)

    def _prune(self) -> None:
        t = self.trainer
        if t.keep_checkpoints is None or t.checkpoint_dir is None:
            return
        agreed = t.replicas.agreed() if t.replicas is not None else None
        for _, _, old in complete_checkpoints(t.checkpoint_dir)[: -t.keep_checkpoints]:
            if agreed is None or str(old) != agreed[1]:  # the rollback target stays
                shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> str | None:
        """Load the newest complete checkpoint in `checkpoint_dir`, if any; returns its path."""
        t = self.trainer
        if t.checkpoint_dir is None or self.guard is None:
            return None
        self.guard.check_shared()
        found, saved = None, None
        if t.rank == 0:
            remove_stale_temps(t.checkpoint_dir)  # leftovers of saves killed before their commit
            found = ckpt.latest(t.checkpoint_dir)
            saved = self.guard.previously_saved() if found is None else None
        path, saved = t.comm.broadcast((found, saved))
        if path is None:
            self.guard.lost(saved)
            return None
        t._load(path)
        return str(path)

    def replicas_agree(self) -> bool:
        """After a step: False when the replicas disagreed and every rank rolled back to the agreed checkpoint."""
        t = self.trainer
        step = t.position.global_step
        if t.replicas is None or not t.replicas.due(step):
            return True
        error = t.replicas.check(step)
        if error is None:
            return True
        self.wait()
        agreed = t.comm.broadcast(t.replicas.agreed() if t.rank == 0 else None)  # one choice for every rank
        if agreed is None or t.checkpoint_dir is None or t.replicas.rollbacks >= MAX_ROLLBACKS:
            why = "no agreed checkpoint to roll back to" if agreed is None else f"{MAX_ROLLBACKS} rollbacks already"
            raise type(error)(f"{error} ({why})", ranks=error.ranks, hosts=error.hosts, step=error.step,
                              group=error.group, rank=error.rank)
        if t.rank == 0:
            warnings.warn(f"axond.train: {error}; rolling back every rank to {agreed[1]} (step {agreed[0]})",
                          RuntimeWarning, stacklevel=3)
            remove_newer(t.checkpoint_dir, agreed[0])  # they may hold the diverged weights
        t.comm.broadcast(None)  # the newer checkpoints are gone before any rank looks again
        t._load(agreed[1])
        t.replicas.rolled_back(agreed[0])
        return False

    def wait(self, timeout: float = 600.0) -> None:
        """Block until the last async checkpoint is committed (re-raises its error)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result(timeout=timeout)

    def close(self) -> None:
        """At the end of `fit`: close the guard's connection to the job's store."""
        if self.guard is not None:
            self.guard.close()
