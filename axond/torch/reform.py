"""torch's default group re-formed in place for a live job's next generation (`axond worker --live-recovery`).

What `axond.reform()` does for axond's own default group, for torch's: wait for this rank's place in the next
generation (the worker's note), destroy torch's default group, set the rank variables to the new place and form the
group again over the "axond" backend, meeting through the coordinator's store of the new generation (the old
rendezvous store, torch's TCPStore on MASTER_PORT, may have left with the failed node), where a rank that joins the
running job meets them too (`axond.torch.rendezvous.live_store`). Also how a failure that
reaches Python through torch (DDP's reducer keeps the message, not the exception's type) is told to be a membership
change: `membership_change`.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from axond.distributed import membership
from axond.distributed.live_place import export_place
from axond.distributed.reform import next_place
from axond.errors import AxondError, DistributedError, MembershipChanged
from axond.torch.process_group import BACKEND, AxondProcessGroup

def membership_change(error: BaseException, wait: bool = True) -> MembershipChanged | None:
    """The `MembershipChanged` behind `error` (itself, or one in its cause and context chain), else, in a live job,
    for a `RuntimeError` (torch's own wrapping of a failed collective), one made from the worker's note of a newer
    generation once it came (waited for up to `AXOND_LIVE_WAIT_S` with `wait`); the same for an axond error (a group
    of a generation that was over as it formed: its store refuses it); None: a failure of its own."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, MembershipChanged):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    live = membership.current()
    if live is None or not isinstance(error, (RuntimeError, AxondError)):
        return None
    if wait:
        membership.nudge(live.path)
    note = live.wait(live.wait_s) if wait else live.newer()
    if note is None:
        return None
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return MembershipChanged(f"the job re-forms as generation {note.generation} ({note.reason}); torch raised: "
                             f"{first[:300]}", generation=note.generation, previous_generation=live.generation,
                             reason=note.reason, op=getattr(error, "op", None), group=getattr(error, "group", None),
                             rank=getattr(error, "rank", None), peer=getattr(error, "peer", None))


def group_timeout(default: float = 300.0) -> timedelta:
    """The timeout torch's default group was formed with (the "axond" backend's), else `default` seconds."""
    if dist.is_initialized():
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        if isinstance(backend, AxondProcessGroup):
            return timedelta(seconds=backend._options.timeout)
    return timedelta(seconds=default)


def reform_torch(timeout: float | None = None) -> membership.Note:
    """Re-form torch's default group over "axond" for the job's next generation; returns this rank's place.

    Every survivor calls it after a membership change, with nothing of torch's default group left in use (a DDP
    wrapper built on it is dropped first: `Manager` does). Waits up to `timeout` seconds (default `AXOND_LIVE_WAIT_S`)
    for the place; raises `DistributedError` outside a live job or when no place came (the job restarts or failed),
    and, without `grow`, when the new generation is larger (a node joined: its new ranks hold no state).
    """
    live = membership.current()
    if live is None:
        raise DistributedError("re-forming torch's group: this process is not in a live job; run it under `axond "
                               "worker --live-recovery` with torch's default group over the \"axond\" backend",
                               op="reform")
    rank = dist.get_rank() if dist.is_initialized() else None
    note = next_place(live, timeout, "torch", rank)
    limit = group_timeout()
    live.end(note.generation)  # the watcher leaves the group formed below alone
    if dist.is_initialized():
        dist.destroy_process_group()
    export_place(note)
    # env:// in a live job meets in the generation's store (`axond.torch.rendezvous.live_store`): where a rank that
    # joins the job in this generation forms its group with the same call
    dist.init_process_group(BACKEND, init_method="env://", rank=note.rank, world_size=note.world_size, timeout=limit)
    live.adopt(note)
    return note
