"""Live recovery on the worker's side: tell the local ranks that their job re-forms, then their new places.

Under `axond worker --live-recovery`, when another node fails and the coordinator opens the next generation with
this node's ranks still running, the worker writes one small JSON file per local rank (`AXOND_MEMBERSHIP_FILE`):
first the new generation and why it opened (`ready` false: the rendezvous is still forming), then, once it froze,
the rank's new place in it (`ready` true). The rank's side reads it (`axond.distributed.membership`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from axond.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from axond.worker.launcher import LocalRanks

MEMBERSHIP_FILE_ENV = "AXOND_MEMBERSHIP_FILE"
LIVE_ENV = "AXOND_LIVE_RECOVERY"


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


def renumber(ranks: LocalRanks, rank_offset: int) -> None:
    """The kept ranks' global ranks in the new generation (failure messages name them by these)."""
    for r in ranks.ranks:
        r.spec = replace(r.spec, rank=rank_offset + r.spec.local_rank)
