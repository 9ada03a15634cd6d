"""How long each rank waits in its collectives, and the rank that everybody waits for (a compute straggler).

Every member of a collective leaves it when the last one arrived, so the rank that arrives last waits least, and
the others wait for it. No clock has to agree with another: each rank measures, on its own monotonic clock, the time
from entering each collective to its end (`ProcessGroup.waited_ns`, a few integer adds per op). Every `window_ops`
collectives of a group (the same ops on every member, so mark k closes after the same op everywhere) it keeps a mark:
the mark's number, its total wait so far and the time (`ProcessGroup.windows`, the last `KEEP_MARKS`). The in-flight
reporter thread publishes the marks of a process's groups under `axond/arrivals/<global rank>` in the job's
coordinator store (only under `axond worker`: off the hot path, at most once a second, JSON).

`stragglers` compares the ranks of a group over windows built from those marks, newest first: a window is the
shortest run of marks whose wall time (the ranks' median) reaches `window_s`, so that it holds at least one step
whatever a step's collectives (no step count to configure), or, while fewer marks are kept than `windows` such
windows need, an equal share of the kept marks. A rank whose wait is below the others' median by more than
`threshold_s` and more than `fraction` of the window's wall time, in the last `windows` windows, is named, with the
time the others lost to it. The worker (`axond.worker.stragglers`) tells it in a notice and a metric; `axond status
--job` and the dashboard show it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from axond.config import StragglerSettings
from axond.store import Store

KEY = "axond/arrivals/{}"
KEEP_MARKS = 64
"""Marks a group keeps (and a rank publishes): 512 collectives at the default 8 per mark, about 4 KB of JSON."""
MAX_RANKS = 256
"""The most ranks whose windows are read and compared (one store read each); larger jobs are not compared."""
NOT_COUNTED = frozenset({"send", "recv", "isend"})
"""Point-to-point ops: members run different numbers of them, so counting them would misalign the windows."""

Window = tuple[int, int, int]
"""A mark: (its number, ns waited in the group's collectives up to it, time.monotonic_ns() at it)."""


def report(groups: Iterable[Any]) -> dict[str, Any]:
    """The marks of `groups` (ProcessGroups) as published:
    {group name: {"ranks": [global ranks], "ops": window_ops, "w": [[k, ns, t], ...]}}; the reporter adds
    "started": the wall-clock time of the process's first mark (readers skip entries that are not groups)."""
    out: dict[str, Any] = {}
    for g in groups:
        windows = list(g.windows)  # a copy: the group's thread appends meanwhile
        if windows:
            out[g.name] = {"ranks": list(g.ranks), "ops": g.window_ops, "w": [list(w) for w in windows]}
    return out


def read_arrivals(store: Store, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """What each of `ranks` last published (ranks with no or an unreadable report left out); the store's errors
    as they are."""
    out: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        raw = store.try_get(KEY.format(rank))
        if raw is None:
            continue
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if isinstance(data, dict):
            out[rank] = data
    return out


@dataclass(frozen=True)
class Straggler:
    """A rank the others of `group` waited for in the last `windows` windows."""

    rank: int
    group: str
    lost_s: float
    """Seconds the others' median wait exceeded this rank's, summed over the windows."""
    span_s: float
    """The windows' wall time (seconds, the ranks' median), summed."""
    ops: int
    """Collectives in the windows."""
    windows: int
    first_mark: int
    """The number of the mark the first window starts at."""
    last_mark: int
    """The number of the mark the last window ends at."""

    @property
    def share(self) -> float:
        return self.lost_s / self.span_s if self.span_s > 0 else 0.0

    def text(self) -> str:
        return (f"rank {self.rank} is a straggler: the other ranks of group '{self.group}' waited {self.lost_s:.3f} s "
                f"more than it in the last {self.span_s:.3f} s ({self.share:.0%} of the time; {self.ops} collectives, "
                f"{self.windows} windows): it arrives last (it computes slower)")

    def short(self) -> str:
        return f"yes: others wait {self.lost_s * 1000:.0f} ms in {self.span_s:.1f} s ({self.share:.0%})"


Marks = dict[int, tuple[int, int]]
"""{mark number: (ns waited up to it, time.monotonic_ns() at it)} of one rank in one group."""


def _marks(windows: Any) -> Marks:
    try:
        return {int(k): (int(ns), int(t)) for k, ns, t in windows}
    except (TypeError, ValueError):
        return {}


def _spans(ranks: Mapping[int, Marks], settings: StragglerSettings) -> list[tuple[int, int]]:
    """The last `settings.windows` windows as (first mark, last mark), oldest first; [] when too few marks agree."""
    low = max(min(m) for m in ranks.values())
    high = min(max(m) for m in ranks.values())
    if any(any(k not in m for k in range(low, high + 1)) for m in ranks.values()):
        return []  # a gap in some rank's marks (it restarted its group): wait for contiguous ones
    most = (high - low) // settings.windows
    if most < 1:
        return []
    want = int(settings.window_s * 1e9)
    spans: list[tuple[int, int]] = []
    end = high
    for _ in range(settings.windows):
        start = end - 1
        while end - start < most and statistics.median(m[end][1] - m[start][1] for m in ranks.values()) < want:
            start -= 1
        spans.append((start, end))
        end = start
    return spans[::-1]


def stragglers(reports: Mapping[int, Mapping[str, Any]], settings: StragglerSettings) -> list[Straggler]:
    """The ranks of `reports` (global rank -> published arrivals) named stragglers, by group, slowest first."""
    by_group: dict[str, dict[int, Marks]] = {}
    ops: dict[str, int] = {}
    for rank, groups in reports.items():
        for name, data in groups.items():
            if not isinstance(data, dict):
                continue
            marks = _marks(data.get("w", []))
            if len(marks) >= 2:
                by_group.setdefault(name, {})[rank] = marks
                ops[name] = int(data.get("ops", settings.window_ops) or settings.window_ops)
    named: list[Straggler] = []
    for name, ranks in by_group.items():
        if len(ranks) < 2:
            continue
        spans = _spans(ranks, settings)
        if not spans:
            continue
        for rank, own in ranks.items():
            lost = span = 0.0
            for a, b in spans:
                others = [(m[b][0] - m[a][0]) / 1e9 for r, m in ranks.items() if r != rank]
                wall = statistics.median((m[b][1] - m[a][1]) / 1e9 for m in ranks.values())
                gap = statistics.median(others) - (own[b][0] - own[a][0]) / 1e9
                if gap < max(settings.threshold_s, settings.fraction * wall):
                    break
                lost, span = lost + gap, span + wall
            else:
                first, last = spans[0][0], spans[-1][1]
                named.append(Straggler(rank, name, lost, span, (last - first) * ops[name], len(spans), first, last))
    return sorted(named, key=lambda s: -s.lost_s)
