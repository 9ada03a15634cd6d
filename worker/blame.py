"""Which failed rank is the root cause: the one the others failed because of, not the first exit seen.

A rank killed by a signal (SIGKILL, the OOM killer, a segfault) writes no error file, and the worker sees its
exit only at its next poll, while the survivors notice the closed connection at once and write error files
older than that. Times alone therefore blame a survivor. Each failure says which rank it failed because of
(`RankExit.blames`: the peer its `DistributedError` names, from the error file, else from the message); a failure
that blames another failed rank is a consequence of it, and the chain of blame ends at the root cause. A rank the
worker itself stopped (it exited after the worker began stopping the ranks, having written no earlier error file)
is never a root cause: the signal was the worker's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axond.worker.launcher import RankExit

_PEER_FAILED = re.compile(r"\brank (\d+) failed: ")
"""How a survivor's DistributedError names the rank whose own failure it saw (always a global rank)."""

_WORLD_PEER = re.compile(r" on group '(?:world|torch|torch:0)' \(rank \d+ of \d+\): peer rank (\d+) ")
"""A default group's peer (its group ranks are the global ranks), for error files that do not give `peer`."""


def blamed(failure: RankExit) -> int | None:
    """The global rank `failure` says it failed because of, or None (its own failure, or it cannot tell)."""
    if failure.blames is not None:
        return failure.blames
    found = _PEER_FAILED.search(failure.message) or _WORLD_PEER.search(failure.message)
    return int(found.group(1)) if found is not None else None


def pick(failures: Sequence[RankExit]) -> RankExit | None:
    """The root cause among `failures` (exits of one node's ranks): follow each failure's blame to a failed rank
    that blames no other failed rank; among several such roots, a rank killed by a signal before the worker
    stopped anything (its death explains the closed connections), else the oldest (`RankExit.failed_at`)."""
    failed = {f.rank: f for f in failures if f.exit_code != 0}
    if not failed:
        return None
    roots: dict[int, RankExit] = {}
    for f in failed.values():
        seen: set[int] = set()
        while f.rank not in seen:
            seen.add(f.rank)
            nxt = failed.get(blamed(f)) if blamed(f) is not None else None  # type: ignore[arg-type]
            if nxt is None or nxt.stopped:
                break
            f = nxt
        roots[f.rank] = f
    candidates = [f for f in roots.values() if not f.stopped] or list(roots.values())
    signalled = [f for f in candidates if f.exit_code > 128 and not f.reported]
    return min(signalled or candidates, key=lambda f: f.failed_at)


def consequences(root: RankExit, failures: Sequence[RankExit]) -> list[int]:
    """The other failed ranks whose failure names `root`'s rank as its cause (directly)."""
    return sorted(f.rank for f in failures if f.exit_code != 0 and f.rank != root.rank and blamed(f) == root.rank)


def describe(root: RankExit, failures: Sequence[RankExit]) -> str:
    """`root.describe()`, plus which local ranks failed because of it: `...; rank(s) 0 failed because of it`."""
    then = consequences(root, failures)
    text = root.describe()
    if then:
        text += f" (then rank{'s' if len(then) > 1 else ''} {', '.join(map(str, then))} failed because of it)"
    return text


def caused_elsewhere(failure: RankExit, local: Sequence[int]) -> bool:
    """Whether `failure` says it is the consequence of a rank that is not one of this node's `local` ranks."""
    cause = blamed(failure)
    return cause is not None and cause not in local and cause != failure.rank
