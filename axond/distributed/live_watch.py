"""Live recovery: a rank's blocked collectives end as soon as its worker says the job moved on.

A peer whose link was cut (its frames dropped both ways) or whose whole host froze closes nothing: no FIN, no reset,
and a survivor's collective blocked on it would wait out the group's timeout. The coordinator declares that node
dead once its lease ran out and opens the next generation with the others; their workers hear of it at their next
heartbeat and write each rank's membership note (`axond.worker.live`). This watcher, one daemon thread in each rank
of a live job (`axond worker --live-recovery`), looks at that note (one `stat` of a local file every WATCH_S, never
the coordinator) and, the first time it names a later generation, interrupts every group of this process: the
peers are told (an abort frame) and the group's own links are shut down, so that the ops blocked on them fail at
once and raise `axond.MembershipChanged` naming the new generation and who left, as after a rank's exit.

`reform()` marks the generation it forms as ended before it forms the group (`LiveMembership.end`), so the watcher
never interrupts the group of the generation this process moved to.
"""

from __future__ import annotations

import os
import threading
import time

from axond.config import RuntimeEnv
from axond.distributed import membership
from axond.distributed.diagnostics.failure import live_groups

WATCH_S = 0.05
"""How often the watcher looks at the membership file: what it adds at most to the survivors' detection."""

_thread: threading.Thread | None = None
_lock = threading.Lock()


def interrupt_groups(reason: str) -> None:
    """Interrupt every live group of this process (`ProcessGroup.interrupt`)."""
    for group in live_groups():
        group.interrupt(reason)


def check(live: membership.LiveMembership) -> bool:
    """One look: if the worker's note names a generation after this process's, interrupt its groups (once per
    generation). Returns whether it did."""
    note = live.newer()
    if note is None:
        return False
    reason = f"the job moved on to generation {note.generation} ({note.reason})"
    return live.end(note.generation, lambda: interrupt_groups(reason))


def _watch() -> None:
    seen: tuple[str, int] | None = None
    while True:
        live = membership.current()
        if live is not None:
            try:
                stamp = (live.path, os.stat(live.path).st_mtime_ns)
            except OSError:
                stamp = None
            if stamp is not None and stamp != seen:  # the worker replaces the note whole: a new file, a new time
                seen = stamp
                try:
                    check(live)
                except Exception:  # noqa: BLE001 - never end the watcher: the ops' own failure path still works
                    seen = None
        time.sleep(WATCH_S)


def start() -> None:
    """Start this process's watcher (once; it runs while the process does and acts only in a live job)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_watch, name="axond-live-watch", daemon=True)
            _thread.start()


def configure(env: RuntimeEnv) -> None:
    """Set up live recovery for a default group formed from `env` (`axond.init_process_group`, and torch's default
    group over the "axond" backend): its membership note and generation, and the watcher in a live job."""
    membership.configure(env.membership_file if env.live_recovery else None, env.generation, env.live_wait_s,
                         env.live_max_world)
    if env.live_recovery and env.membership_file:
        start()  # a peer cut off (no EOF to come): end the blocked ops at the worker's word
