"""Live recovery on the worker's side: tell the local ranks that their job re-forms, then their new places.

Under `axond worker --live-recovery`, when another node fails and the coordinator opens the next generation with
this node's ranks still running, the worker writes one small JSON file per local rank (`AXOND_MEMBERSHIP_FILE`):
first the new generation and why it opened (`ready` false: the rendezvous is still forming), then, once it froze,
the rank's new place in it (`ready` true). The rank's side reads it (`axond.distributed.membership`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from axond.distributed.membership import nudge_path
from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.worker.launcher import LocalRanks

MEMBERSHIP_FILE_ENV = "AXOND_MEMBERSHIP_FILE"
LIVE_ENV = "AXOND_LIVE_RECOVERY"
MAX_WORLD_ENV = "AXOND_LIVE_MAX_WORLD"
"""The most ranks the job may grow to (`--nnodes` MAX x `--nproc-per-node`): the trainer's default virtual ranks."""


def membership_path(directory: str, local_rank: int) -> str:
    """The membership file of local rank `local_rank` (in the runner's private directory)."""
    return os.path.join(directory, f"membership-local{local_rank}.json")


def write_note(path: str, note: dict[str, object]) -> None:
    """Replace the file at `path` with `note` atomically (a reader sees the old note or the new one, whole)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(note, f)
    os.replace(tmp, path)


def announce(paths: list[str], generation: int, reason: str) -> None:
    """The job moved to `generation` (`reason`: who left, why); the ranks' places in it are not known yet."""
    for path in paths:
        write_note(path, {"generation": generation, "ready": False, "reason": reason})


def assign(paths: list[str], joined: pb.JoinResponse, reason: str) -> None:
    """The new generation froze: each local rank's new place in it (ranks, world size, the data plane's secret)."""
    for local_rank, path in enumerate(paths):
        write_note(path, {
            "generation": joined.generation, "ready": True, "reason": reason,
            "rank": joined.rank_offset + local_rank, "world_size": joined.world_size, "local_rank": local_rank,
            "local_world_size": joined.local_world_size, "node_rank": joined.node_rank, "nnodes": joined.nnodes,
            "job_secret": joined.job_secret.hex(),
        })


NUDGE_EVERY_S = 0.1
"""How often a worker heartbeats while one of its ranks waits for word of the job's next generation."""
NUDGE_FOR_S = 30.0
"""How long a rank's request to hear from the coordinator now is honoured (its wait, `AXOND_LIVE_WAIT_S`)."""


class Nudges:
    """The local ranks' requests to heartbeat now (a rank lost a peer): the job is about to move to the next
    generation, and the survivors should hear of it at once, not at their next heartbeat interval."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = [nudge_path(p) for p in paths]
        self._last = 0.0

    def due(self, now: float) -> bool:
        """Whether a rank asked within NUDGE_FOR_S and the last nudged heartbeat is NUDGE_EVERY_S old."""
        if now - self._last < NUDGE_EVERY_S:
            return False
        for path in self.paths:
            try:
                age = time.time() - os.stat(path).st_mtime
            except OSError:
                continue
            if age < NUDGE_FOR_S:
                self._last = now
                return True
        return False

    def clear(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):
                os.remove(path)


def renumber(ranks: LocalRanks, rank_offset: int) -> None:
    """The kept ranks' global ranks in the new generation (failure messages name them by these)."""
    for r in ranks.ranks:
        r.spec = replace(r.spec, rank=rank_offset + r.spec.local_rank)
