"""A rank's collective counters, written to a small file its worker reads when /metrics is scraped
(`DIR/rank-JOB-RANK.json`).

Per (op, group): calls, bytes, a latency histogram and the time the caller was blocked. Recording takes a lock
and a few additions; a background thread rewrites the file (atomically: a temporary file renamed
over it) at most once per FLUSH_INTERVAL_S when something changed, and once more at exit.
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import re
import threading
from pathlib import Path

LATENCY_BOUNDS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
"""Upper bounds (seconds) of the collective latency histogram's buckets (then +Inf)."""
FLUSH_INTERVAL_S = 1.0
"""How often a changed rank file is rewritten (what /metrics shows lags the rank by at most this)."""


class OpStats:
    """What one op on one group did so far."""

    __slots__ = ("calls", "bytes", "seconds", "blocked", "buckets")

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.seconds = 0.0
        self.blocked = 0.0
        self.buckets = [0] * (len(LATENCY_BOUNDS_S) + 1)


class RankMetrics:
    """The counters of this rank; `record` is thread-safe."""

    def __init__(self, directory: str, rank: str, job: str, generation: str) -> None:
        safe_job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64]
        self.path = Path(directory) / f"rank-{safe_job}-{rank}.json"
        """One file per job and rank (a daemon runs ranks of several jobs); a restarted rank takes it over."""
        self.rank, self.job, self.generation = rank, job, generation
        self._stats: dict[tuple[str, str], OpStats] = {}
        self._lock = threading.Lock()
        self._dirty = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="axond-rank-metrics", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def record(self, op: str, group: str, nbytes: int, seconds: float, blocked: float) -> None:
        """One finished call: `seconds` from its start to its end, `blocked` of them spent in the caller."""
        with self._lock:
            s = self._stats.get((op, group))
            if s is None:
                s = self._stats[(op, group)] = OpStats()
            s.calls += 1
            s.bytes += nbytes
            s.seconds += seconds
            s.blocked += blocked
            s.buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
            self._dirty = True

    def add_blocked(self, op: str, group: str, seconds: float) -> None:
        """Time spent waiting for an async op's Work (counted when the wait returns)."""
        with self._lock:
            s = self._stats.get((op, group))
            if s is None:
                s = self._stats[(op, group)] = OpStats()
            s.blocked += seconds
            self._dirty = True

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            ops = [{"op": op, "group": group, "calls": s.calls, "bytes": s.bytes, "seconds": s.seconds,
                    "blocked": s.blocked, "buckets": list(s.buckets)} for (op, group), s in self._stats.items()]
            self._dirty = False
        return {"rank": self.rank, "job": self.job, "generation": self.generation, "pid": os.getpid(),
                "bounds": list(LATENCY_BOUNDS_S), "ops": ops}

    def flush(self) -> None:
        """Rewrite the rank file now (atomically)."""
        data = json.dumps(self.snapshot(), separators=(",", ":"))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(data)
            os.replace(tmp, self.path)
        except OSError:
            pass  # the worker's directory went away (it is stopping): nothing to report to

    def _flush_loop(self) -> None:
        while not self._stopped.wait(FLUSH_INTERVAL_S):
            if self._dirty:
                self.flush()

    def close(self) -> None:
        self._stopped.set()
        if self._dirty or not self.path.exists():
            self.flush()
