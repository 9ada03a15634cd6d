"""The worker names its local ranks that the job waits for (compute stragglers), from the ranks' arrival windows.

Ranks publish how long they waited in each window of collectives (`axond.distributed.diagnostics.arrivals`); every
`POLL_S` (less often for jobs of over 64 ranks) the worker reads those of the job's ranks, and for each local rank
that `arrivals.stragglers` names it says so once (a notice with the time lost), says when it is no longer one, and
counts the seconds the others lost to it for its metrics endpoint (`axond_straggler_seconds_total`,
`axond_straggler`: a file in the directory its ranks report into, `axond.observe.worker_metrics`). Each worker names
only its own ranks: one notice per straggler.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axond.config import StragglerSettings
from axond.distributed.diagnostics.arrivals import MAX_RANKS, Straggler, read_arrivals, stragglers
from axond.errors import CoordinatorError, StoreError

if TYPE_CHECKING:
    from axond.control.client import CoordinatorClient

POLL_S = 1.0
"""Seconds between two reads of the ranks' arrival windows (at least)."""
READS_PER_S = 64
"""The most store reads a second a worker makes for them: a job of N ranks is read every max(POLL_S, N / 64) s."""
METRICS_FILE = "stragglers-{}.json"

Reader = Callable[[Sequence[int]], Mapping[int, Mapping[str, Any]] | None]


def arrivals_reader(client: CoordinatorClient, job: str, generation: int) -> Reader:
    """Reads the ranks' arrival windows from the generation's coordinator store; None when it cannot be read."""
    store = client.store(job, generation)

    def read(ranks: Sequence[int]) -> Mapping[int, Mapping[str, Any]] | None:
        try:
            return read_arrivals(store, ranks)
        except (CoordinatorError, StoreError, ValueError):  # ValueError: the client was closed (the generation ended)
            return None

    return read


class StragglerWatch:
    """Call `check` on each monitor tick; it reads and compares every `every` seconds."""

    def __init__(self, job: str, notice: Callable[[str], None], read: Reader, world_size: int, local: Sequence[int],
                 settings: StragglerSettings, metrics_dir: str = "", every: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._job, self._notice, self._read, self._settings = job, notice, read, settings
        self._world = world_size if settings.window_ops > 0 and 1 < world_size <= MAX_RANKS else 0
        self._local = set(local)
        self._every, self._clock = max(every, self._world / READS_PER_S), clock
        self._next = clock() + every
        self._named: dict[int, Straggler] = {}
        self._counted: dict[tuple[int, str], int] = {}
        """(rank, group) -> the last mark up to which the lost time is in `lost_s`."""
        self.lost_s: dict[int, float] = {r: 0.0 for r in self._local}
        """Seconds the other ranks waited for each local rank while it was named (the metric)."""
        self._file = Path(metrics_dir) / METRICS_FILE.format(job) if metrics_dir else None

    @property
    def named(self) -> dict[int, Straggler]:
        """The local ranks named now."""
        return dict(self._named)

    def check(self) -> None:
        now = self._clock()
        if not self._world or now < self._next:
            return
        self._next = now + self._every
        reports = self._read(range(self._world))
        if reports is None:
            return
        found = {s.rank: s for s in reversed(stragglers(reports, self._settings)) if s.rank in self._local}
        for rank, s in sorted(found.items()):
            key = (rank, s.group)
            first = max(self._counted.get(key, s.first_mark), s.first_mark)
            if s.last_mark > first:  # the marks not yet counted, at the windows' mean loss per mark
                self.lost_s[rank] += s.lost_s * (s.last_mark - first) / (s.last_mark - s.first_mark)
                self._counted[key] = s.last_mark
            if rank not in self._named:
                self._notice(f"job {self._job!r}: {s.text()}")
        for rank in sorted(set(self._named) - set(found)):
            self._notice(f"job {self._job!r}: rank {rank} is no longer a straggler")
            self._counted = {k: v for k, v in self._counted.items() if k[0] != rank}
        self._named = found
        self._write()

    def _write(self) -> None:
        if self._file is None:
            return
        data = {"job": self._job, "ranks": {str(r): {"seconds": self.lost_s[r], "named": int(r in self._named)}
                                             for r in sorted(self._local)}}
        tmp = self._file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._file)
        except OSError:
            pass  # the metrics directory went away (the worker stops): only the metric is lost
