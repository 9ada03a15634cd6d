"""Live recovery at a step boundary: the worker's word that the job moved to a newer generation, before any
collective fails.

A node that joins a running live job cuts no collective: the running ranks learn of the new generation from their
workers' note (`AXOND_MEMBERSHIP_FILE`) and must leave the old group together. A loop calls `moved_on(group)` between
steps (one `stat` of the note while nothing changed): when a newer generation is announced it tells the group's other
members (`abort`: a rank already blocked in the next step's collective raises at once, and becomes
`MembershipChanged` there too) and returns the `MembershipChanged` to raise; the loop then calls `axond.reform()`.
"""

from __future__ import annotations

import contextlib
import os

from axond.distributed import membership
from axond.distributed.process_group import ProcessGroup
from axond.errors import MembershipChanged

_seen: tuple[str, int, int, int] | None = None
"""(path, inode, mtime_ns, size) of the note last found not newer: the file is read again only when it changed."""


def moved_on(group: ProcessGroup) -> MembershipChanged | None:
    """The job's move to a newer generation as `MembershipChanged` (the group's others told), or None."""
    global _seen
    live = membership.current()
    if live is None:
        return None
    try:
        st = os.stat(live.path)
    except OSError:
        return None
    key = (live.path, st.st_ino, st.st_mtime_ns, st.st_size)
    if key == _seen:
        return None
    note = live.newer()
    if note is None:
        _seen = key
        return None
    _seen = None
    with contextlib.suppress(Exception):  # a group already broken has no one left to tell
        group.abort(f"the job moves to generation {note.generation} at a step boundary ({note.reason})")
    return MembershipChanged(
        f"the job re-forms as generation {note.generation} ({note.reason}); call axond.reform() and go on",
        generation=note.generation, previous_generation=live.generation, reason=note.reason, op="step boundary",
        group=group.name, rank=group.rank)
