"""The garbage collector of a process that serves as the coordinator: collected less often, startup frozen.

Python's cyclic collector runs a young collection every 700 new container objects and, every so often, a
full one over every object the process holds. A coordinator of 10,000 nodes holds millions of them
(nodes, their leases, the parked Joins and streams), and a rendezvous of them all at once allocates
a few per call: with the default thresholds the collector took about a fifth of the coordinator's
CPU while it served such a rendezvous. Serving, the coordinator collects young objects every
`YOUNG` allocations instead, and what it loaded at startup (modules, the restored state) is frozen
out of every collection. Memory freed by reference counting (nearly all of it) is unaffected; only
garbage in reference cycles waits longer, bounded by the thresholds.

Only a process that is the coordinator (`axond coordinator`, `run_coordinator`) tunes it: the
collector is the process's, so a coordinator started inside another program (`start_coordinator`)
leaves that program's settings alone.
"""

from __future__ import annotations

import gc

YOUNG = 100_000
"""New container objects between young collections (Python's default: 700)."""
MIDDLE = 50
"""Young collections between collections of the middle generation (default 10)."""
OLD = 100
"""Middle collections between full collections, at most (default 10; a full one also waits until the objects
that survived since the last one are a quarter of those it would look at)."""


def tune_for_serving() -> tuple[int, int, int]:
    """Freeze what the process holds now and collect less often; returns the thresholds it replaced."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
    return before
