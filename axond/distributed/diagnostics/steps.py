"""The ends of a process's training steps, for the coordinator's dashboard: `axond.mark_step()`.

The data plane sees collectives, not steps: a step may run one collective or hundreds. A loop that calls
`axond.mark_step()` after each optimizer step (`DistributedTrainer` does) keeps the last `KEEP_STEPS` step ends
here, as (the step's number in this process, time.monotonic_ns()); the in-flight reporter thread publishes them with
the process's arrival marks (`arrivals`, under `axond worker`, at most once a second), and the dashboard plots the
time between consecutive ones: the job's recent step times. Marking costs a lock and an append.
"""

from __future__ import annotations

import threading
import time
from collections import deque

KEEP_STEPS = 64
"""Step ends kept (and published): about 1 KB of JSON."""
FIELD = "steps"
"""Where the marks go in a rank's published arrivals report (readers skip entries that are not groups)."""

_lock = threading.Lock()
_marks: deque[tuple[int, int]] = deque(maxlen=KEEP_STEPS)
_count = 0


def mark_step() -> None:
    """Record that this process finished a training step (call it after each optimizer step; the dashboard then
    plots the job's step times instead of the time per 8 collectives)."""
    global _count
    now = time.monotonic_ns()
    with _lock:
        _count += 1
        _marks.append((_count, now))


def recent() -> list[list[int]]:
    """The kept step ends, oldest first, as [[number, time.monotonic_ns()], ...]."""
    with _lock:
        return [list(m) for m in _marks]
