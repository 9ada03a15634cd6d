"""A live job's rank taking its place in a later generation: the worker's note read, the rank variables set.

Used by `axond.reform()` (a survivor's next generation) and by `init_process_group` (a rank whose first generation
ended before its group formed: another node left, or one joined, meanwhile).
"""

from __future__ import annotations

import time

from axond.config import RuntimeEnv, export_rank_variables
from axond.distributed import membership


def export_place(note: membership.Note) -> None:
    """Set the rank variables (RANK, WORLD_SIZE, AXOND_GENERATION, the job secret, ...) to `note`'s place."""
    export_rank_variables(dict(
        RANK=str(note.rank), WORLD_SIZE=str(note.world_size), LOCAL_RANK=str(note.local_rank),
        LOCAL_WORLD_SIZE=str(note.local_world_size), NODE_RANK=str(note.node_rank), GROUP_RANK=str(note.node_rank),
        GROUP_WORLD_SIZE=str(note.nnodes), ROLE_RANK=str(note.rank), ROLE_WORLD_SIZE=str(note.world_size),
        AXOND_GENERATION=str(note.generation), AXOND_JOB_SECRET=note.job_secret.hex(),
    ))


def later_place(path: str, generation: int, deadline: float) -> membership.Note | None:
    """The worker's note of this rank's place in a generation after `generation`, waited for until `deadline`
    (`time.monotonic()`); None if none came."""
    while True:
        note = membership.read_note(path)
        if note is not None and note.generation > generation and note.ready:
            return note
        if time.monotonic() >= deadline:
            return None
        time.sleep(membership.POLL_S)


def moved_on(env: RuntimeEnv, wait: bool) -> membership.Note | None:
    """For a rank of a live job (`env` from its worker) that could not form its first group: its place in the later
    generation the worker names (`wait`: waited for up to `AXOND_LIVE_WAIT_S`, else only if it is known now), with
    the rank variables set to it; None when this is not a live job or the job did not move on (the error stands)."""
    if not (env.live_recovery and env.membership_file) or membership.current() is not None:
        return None  # not a live job, or a rank past its first group: `axond.reform()` takes the later generation
    note = later_place(env.membership_file, env.generation, time.monotonic() + (env.live_wait_s if wait else 0.0))
    if note is not None:
        export_place(note)
    return note
