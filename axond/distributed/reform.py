"""`axond.reform()`: after `MembershipChanged`, take this process's place in the job's next generation.

The same process, the same imports, the same user objects: the default group is destroyed and formed again over
the new generation's store (its ranks, world size and data-plane secret from the worker's note), and the
variables a rank reads (RANK, WORLD_SIZE, AXOND_GENERATION, ...) say the new values. `axond.torch.live` re-forms
torch's default group with the same two steps (`next_place`, `export_place`).
"""

from __future__ import annotations

import time

from axond.distributed import default_registry as defaults
from axond.distributed import membership
from axond.distributed.api import destroy_process_group, init_process_group, read_env
from axond.distributed.live_place import export_place, later_place
from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError, StoreError


def next_place(live: membership.LiveMembership, timeout: float | None, group: str | None = None,
               rank: int | None = None) -> membership.Note:
    """This rank's place in the generation after `live`'s, waited for up to `timeout` seconds (default
    `AXOND_LIVE_WAIT_S`); raises `DistributedError` when none came (the job restarts or failed)."""
    wait = live.wait_s if timeout is None else timeout
    note = live.wait(wait, ready=True)
    if note is None:
        raise DistributedError(f"axond.reform(): no place for this rank in a generation after {live.generation} came "
                               f"within {wait:g} s (the job restarts or failed; see the worker's output)",
                               op="reform", group=group, rank=rank)
    return note


def reform(timeout: float | None = None) -> ProcessGroup:
    """Re-form the default group for the job's next generation and return it (every survivor calls it).

    Waits up to `timeout` seconds (default `AXOND_LIVE_WAIT_S`) for the worker to say this rank's place in the new
    generation, then forms the group there with the old group's backend and timeout. Raises `DistributedError` when
    this is not a live job (`axond worker --live-recovery`), or no place came in time (the job restarts or failed).
    When the job moves on again while the group forms (another node left or joined meanwhile, so that generation's
    store refuses it or its peers never come), it forms the group of the later generation the worker names instead.
    """
    live = membership.current()
    old = defaults.current()
    if live is None or old is None:
        raise DistributedError("axond.reform(): this process is not in a live job's default group; run it under "
                               "`axond worker --live-recovery` after axond.init_process_group()", op="reform")
    note = next_place(live, timeout, old.name, old.global_rank)
    backend, group_timeout = old.backend_name, old.timeout
    deadline = time.monotonic() + (live.wait_s if timeout is None else timeout)
    destroy_process_group()
    while True:
        live.end(note.generation)  # the watcher leaves the group formed below alone
        export_place(note)
        try:
            group = init_process_group(backend, timeout=group_timeout, env=read_env())
        except (StoreError, DistributedError):
            # the job moved on while this rank formed its group (another node left or joined meanwhile): take its
            # place in the later generation the worker names; none within the wait: the error as it is
            later = later_place(live.path, note.generation, deadline)
            if later is None:
                raise
            note = later
            continue
        live.adopt(note)
        return group

