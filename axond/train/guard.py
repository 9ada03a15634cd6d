"""Checks that a trainer's checkpoints cannot vanish silently.

Every rank writes its shard of a checkpoint into the checkpoint directory and rank 0 commits it, so all ranks must
see one directory (storage they share): rank 0 writes a probe file there and every rank looks for it. And a
generation restarted by `axond worker` that finds no checkpoint where an earlier generation of the job saved one
(the job's KV store at the coordinator remembers the last save under a key that outlives restarts) has lost it:
the directory is not the one that generation saved into, or not shared. `guard`: "warn" (the default), "error"
(raise `CheckpointGuardError` on every rank), "off".
"""

from __future__ import annotations

import secrets
import socket
import warnings
from pathlib import Path
from typing import Literal

from axond.checkpoint.api import ObjectCollectives
from axond.config import ConfigError, RuntimeEnv
from axond.errors import AxondError
from axond.store.base import Store
from axond.store.init_methods import OpenedStore, open_job_store

Guard = Literal["warn", "error", "off"]
GUARDS: tuple[Guard, ...] = ("warn", "error", "off")
SAVED_KEY = "axond/job/checkpoint"
"""The job's last committed checkpoint, "STEP PATH" (the coordinator carries `axond/job/` keys over restarts)."""
PROBE_PREFIX = ".axond-probe-"
SHARED_STORAGE_HINT = ("put checkpoint_dir on storage every rank shares (a network file system; on Kubernetes a "
                       "ReadWriteMany volume, see docs/kubernetes.md)")


class CheckpointGuardError(AxondError, RuntimeError):
    """The checkpoint directory is not one directory for every rank, or a restart lost the job's checkpoint."""


def _close(opened: OpenedStore) -> None:
    for close in opened.closers:
        close()


class CheckpointGuard:
    """The checks of one trainer (collective calls: every rank of its group makes them)."""

    def __init__(self, mode: str, comm: ObjectCollectives, directory: Path, env: RuntimeEnv | None = None) -> None:
        if mode not in GUARDS:
            raise ValueError(f"checkpoint_guard must be one of {GUARDS}, got {mode!r}")
        self.mode = mode
        self.comm = comm
        self.directory = directory
        if env is None:
            try:
                env = RuntimeEnv.from_env(strict=False)
            except ConfigError:
                env = RuntimeEnv()
        self.env = env
        self._store: OpenedStore | None = None
        self._store_failed = False

    @property
    def restarted(self) -> bool:
        """Whether this is a restart of the job: AXOND_GENERATION > 1, or torchrun's TORCHELASTIC_RESTART_COUNT > 0."""
        count = self.env.restart_count
        return self.env.generation > 1 or (count is not None and count.isdigit() and int(count) > 0)

    def complain(self, message: str) -> None:
        """Raise (mode "error", on every rank) or warn (rank 0)."""
        if self.mode == "error":
            raise CheckpointGuardError(message)
        if self.comm.rank == 0:
            warnings.warn(f"axond.train: {message}", RuntimeWarning, stacklevel=3)

    def check_shared(self) -> None:
        """Every rank sees the file rank 0 writes into the directory; else complain naming the ranks that do not."""
        if self.mode == "off":
            return
        name = ""
        if self.comm.rank == 0:
            name = PROBE_PREFIX + secrets.token_hex(8)
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / name).write_text("written by rank 0 of an axond.train.DistributedTrainer\n")
        name = self.comm.broadcast(name)
        mine = ((self.directory / name).is_file(), socket.gethostname(), str(self.directory.resolve()))
        seen: list[tuple[bool, str, str]] = self.comm.all_gather(mine)
        if self.comm.rank == 0:
            (self.directory / name).unlink(missing_ok=True)
        blind = [r for r, (found, _, _) in enumerate(seen) if not found]
        if blind:
            where = "; ".join(f"rank {r} on {seen[r][1]} looks in {seen[r][2]}" for r in blind[:8])
            more = f" (and {len(blind) - 8} more)" if len(blind) > 8 else ""
            self.complain(
                f"checkpoint_dir is not one directory for every rank: rank 0 on {seen[0][1]} wrote a file into "
                f"{seen[0][2]} that {len(blind)} rank(s) do not see ({where}{more}); each node would keep only its "
                f"own shards and a restart would start from scratch: {SHARED_STORAGE_HINT}"
            )

    def _job_store(self) -> Store | None:
        """Rank 0's store of the job generation at the coordinator (None outside an axond job, or unreachable)."""
        if self._store is None and not self._store_failed:
            try:
                self._store = open_job_store(self.env)
            except (AxondError, OSError) as e:
                self._store_failed = True
                warnings.warn(f"axond.train: cannot reach the job's store to check checkpoints: {e}", RuntimeWarning,
                              stacklevel=3)
            if self._store is None:
                self._store_failed = True
        return self._store.store if self._store is not None else None

    def previously_saved(self) -> str | None:
        """On rank 0 of a restarted generation: "STEP PATH" of the job's last saved checkpoint, if it saved one."""
        if self.mode == "off" or self.comm.rank != 0 or not self.restarted:
            return None
        store = self._job_store()
        if store is None:
            return None
        try:
            value = store.try_get(SAVED_KEY)
        except AxondError:
            return None
        return value.decode(errors="replace") if value is not None else None

    def lost(self, saved: str | None) -> None:
        """Complain if an earlier generation saved `saved` and this one found no checkpoint."""
        if saved is None:
            return
        step, _, path = saved.partition(" ")
        self.complain(
            f"generation {self.env.generation} of job {self.env.job!r} found no complete checkpoint in "
            f"{self.directory}, but an earlier generation saved one at step {step} ({path}): it resumes from scratch. "
            f"The directory is not the storage that generation saved to: {SHARED_STORAGE_HINT}"
        )

    def saved(self, step: int, path: str) -> None:
        """On rank 0, after a checkpoint committed: remember it in the job's store (best effort)."""
        if self.mode == "off" or self.comm.rank != 0:
            return
        store = self._job_store()
        if store is None:
            return
        try:
            store.set(SAVED_KEY, f"{step} {path}".encode())
        except AxondError as e:
            warnings.warn(f"axond.train: cannot record the checkpoint in the job's store: {e}", RuntimeWarning,
                          stacklevel=3)

    def close(self) -> None:
        if self._store is not None:
            opened, self._store = self._store, None
            _close(opened)
