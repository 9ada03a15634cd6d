"""Live recovery on the rank's side: the worker's word that the job re-forms, read from `AXOND_MEMBERSHIP_FILE`.

Under `axond worker --live-recovery`, a collective that fails because a peer left waits (up to
`AXOND_LIVE_WAIT_S`) for the worker's note of the next generation and then raises `MembershipChanged` in place of
the peer's failure; `axond.reform()` waits for this rank's place in that generation and re-forms the default group.
The note's format is the worker's (`axond.worker.live`); this module imports no other layer but the errors.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from axond.errors import DistributedError, MembershipChanged

POLL_S = 0.01
"""How often a waiting rank looks at its membership file (a stat and, when it changed, a small read)."""


@dataclass(frozen=True)
class Note:
    """What the worker last wrote: the generation the job moved to and, once it froze, this rank's place in it."""

    generation: int
    reason: str
    ready: bool
    rank: int = -1
    world_size: int = 0
    local_rank: int = 0
    local_world_size: int = 0
    node_rank: int = 0
    nnodes: int = 0
    job_secret: bytes = b""


def read_note(path: str) -> Note | None:
    """The note at `path`, or None while there is none (the worker replaces it whole: never half a note)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        return Note(int(raw["generation"]), str(raw.get("reason", "")), bool(raw.get("ready", False)),
                    int(raw.get("rank", -1)), int(raw.get("world_size", 0)), int(raw.get("local_rank", 0)),
                    int(raw.get("local_world_size", 0)), int(raw.get("node_rank", 0)), int(raw.get("nnodes", 0)),
                    bytes.fromhex(str(raw.get("job_secret", ""))))
    except (KeyError, TypeError, ValueError):
        return None


def nudge_path(path: str) -> str:
    """Where a rank asks its worker to hear from the coordinator now (beside its membership file)."""
    return path + ".nudge"


def nudge(path: str, cause: str = "") -> None:
    """Ask the worker to heartbeat now (a peer was lost: the job is about to move), not at its next interval; `cause`
    (the failed collective, naming op, group and peer) is what the worker says if its node is the one left out."""
    with contextlib.suppress(OSError):
        with open(nudge_path(path), "w", encoding="utf-8") as f:
            f.write(cause[:1000])


class LiveMembership:
    """This process's part in a live job: its membership file and the generation its default group belongs to."""

    def __init__(self, path: str, generation: int, wait_s: float, max_world: int = 0) -> None:
        self.path = path
        self.generation = generation
        self.wait_s = wait_s
        self.max_world = max_world
        """The most ranks the job may grow to (`AXOND_LIVE_MAX_WORLD`; 0: unknown)."""
        self.ended = generation
        """The latest generation for which this process's older groups were ended (by `end`)."""
        self._lock = threading.Lock()

    def newer(self, ready: bool = False) -> Note | None:
        """The worker's note of a generation after this one (`ready`: only once this rank's place in it is known)."""
        note = read_note(self.path)
        if note is None or note.generation <= self.generation or (ready and not note.ready):
            return None
        return note

    def wait(self, timeout: float, ready: bool = False) -> Note | None:
        """`newer(ready)`, waited for up to `timeout` seconds (None if it did not come)."""
        deadline = time.monotonic() + timeout
        while True:
            note = self.newer(ready)
            if note is not None or time.monotonic() >= deadline:
                return note
            time.sleep(POLL_S)

    def changed(self, error: DistributedError) -> DistributedError:
        """`error` (a collective of this generation failed) as `MembershipChanged` once the worker says the job moved
        on; `error` itself if no word came within `wait_s` (the job restarts or fails: the worker stops this rank)."""
        if isinstance(error, MembershipChanged):
            return error
        nudge(self.path, str(error))
        note = self.wait(self.wait_s)
        if note is None:
            return error
        return MembershipChanged(
            f"{error.op or 'collective'} on group '{error.group}' was cut: the job re-forms as generation "
            f"{note.generation} ({note.reason}); call axond.reform() and run the step again",
            generation=note.generation, previous_generation=self.generation, reason=note.reason, op=error.op,
            group=error.group, rank=error.rank, peer=error.peer)

    def end(self, generation: int, interrupt: Callable[[], None] | None = None) -> bool:
        """The job moved to `generation`: run `interrupt` (end the older generation's groups) unless that was done for
        it already or this process belongs to it; under the lock, so that `reform()`'s call (without `interrupt`,
        before it forms the new group) keeps the watcher (`axond.distributed.live_watch`) from ending the new group."""
        with self._lock:
            if generation <= max(self.ended, self.generation):
                return False
            self.ended = generation
            if interrupt is not None:
                interrupt()
            return True

    def adopt(self, note: Note) -> None:
        """This process's default group now belongs to `note`'s generation."""
        with self._lock:
            self.generation = note.generation


_live: LiveMembership | None = None


def configure(path: str | None, generation: int, wait_s: float, max_world: int = 0) -> None:
    """Set up (or, without `path`, turn off) live recovery for this process's default group of `generation`."""
    global _live
    if not path:
        _live = None
    elif _live is None or _live.path != path:
        _live = LiveMembership(path, generation, wait_s, max_world)
    else:
        _live.generation, _live.wait_s, _live.max_world = generation, wait_s, max_world


def current() -> LiveMembership | None:
    """This process's live membership (None: not a live job)."""
    return _live


def surfaced(error: DistributedError, abort: Callable[[str], None]) -> DistributedError:
    """What a failed collective raises: in a live job, first tell the group's other members (`abort`: those blocked on
    this rank raise at once), then `MembershipChanged` once the worker says the job moved on; else `error`."""
    live = _live
    if live is None or isinstance(error, MembershipChanged):
        return error
    with contextlib.suppress(Exception):  # a group already broken has no one left to tell
        abort(f"a peer left a live job: {error}")
    return live.changed(error)
