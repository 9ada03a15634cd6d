"""How long each rank waits in its collectives, and the rank that everybody waits for (a compute straggler).

Every member of a collective leaves it when the last one arrived, so the rank that arrives last waits least, and
the others wait for it. No clock has to agree with another: each rank measures, on its own monotonic clock, the time
from entering each collective to its end (`ProcessGroup.waited_ns`, a few integer adds per op). Every
`window_ops` collectives of a group (the same ops on every member, so window k is the same ops everywhere) it keeps
the window's number, its total wait so far and the time (`ProcessGroup.windows`). The in-flight reporter thread
publishes the last windows of a process's groups under `axond/arrivals/<global rank>` in the job's coordinator
store (only under `axond worker`: off the hot path, at most once a second, JSON).

`stragglers` compares the ranks of a group window by window: a rank whose wait is below the others' median by
more than `threshold_s` and more than `fraction` of the window's wall time, in the last `windows` windows in a
row, is named, with the time the others lose to it per window (their median wait minus its own). The worker
(`axond.worker.stragglers`) tells it in a notice and a metric; `axond status --job` shows it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from axond.config import MAX_STRAGGLER_WINDOWS, StragglerSettings
from axond.store import Store

KEY = "axond/arrivals/{}"
KEEP_WINDOWS = MAX_STRAGGLER_WINDOWS + 1
"""Closed windows a group keeps (and a rank publishes): AXOND_STRAGGLER_WINDOWS + 1 are needed."""
MAX_RANKS = 256
"""The most ranks whose windows are read and compared (one store read each); larger jobs are not compared."""
NOT_COUNTED = frozenset({"send", "recv", "isend"})
"""Point-to-point ops: members run different numbers of them, so counting them would misalign the windows."""

Window = tuple[int, int, int]
"""(window number, ns waited in the group's collectives up to its end, time.monotonic_ns() at its end)."""


def report(groups: Iterable[Any]) -> dict[str, Any]:
    """The windows of `groups` (ProcessGroups) as published:
    {group name: {"ranks": [global ranks], "ops": window_ops, "w": [[k, ns, t], ...]}}."""
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
    """Seconds per window the others' median wait exceeded this rank's (mean of those windows)."""
    window_s: float
    """The windows' mean wall time (seconds, the others' median)."""
    window_ops: int
    """Collectives per window."""
    windows: int
    last_window: int
    """The number of the last window counted."""

    @property
    def share(self) -> float:
        return self.lost_s / self.window_s if self.window_s > 0 else 0.0

    def text(self) -> str:
        return (f"rank {self.rank} is a straggler: the other ranks of group '{self.group}' waited {self.lost_s:.3f} s "
                f"more than it per {self.window_ops} collectives ({self.share:.0%} of the time), in the last "
                f"{self.windows} windows: it arrives last (it computes slower)")

    def short(self) -> str:
        return f"yes: others wait {self.lost_s * 1000:.0f} ms/{self.window_ops} ops ({self.share:.0%})"


def _per_window(windows: Any) -> dict[int, tuple[int, int]]:
    """{k: (ns waited in window k, wall ns of window k)} for each window whose predecessor is known too."""
    try:
        marks = {int(k): (int(ns), int(t)) for k, ns, t in windows}
    except (TypeError, ValueError):
        return {}
    return {k: (ns - marks[k - 1][0], t - marks[k - 1][1]) for k, (ns, t) in marks.items() if k - 1 in marks}


def stragglers(reports: Mapping[int, Mapping[str, Any]], settings: StragglerSettings) -> list[Straggler]:
    """The ranks of `reports` (global rank -> published arrivals) named stragglers, by group, slowest first."""
    by_group: dict[str, dict[int, dict[int, tuple[int, int]]]] = {}
    ops: dict[str, int] = {}
    for rank, groups in reports.items():
        for name, data in groups.items():
            if not isinstance(data, dict):
                continue
            windows = _per_window(data.get("w", []))
            if windows:
                by_group.setdefault(name, {})[rank] = windows
                ops[name] = int(data.get("ops", settings.window_ops) or settings.window_ops)
    named: list[Straggler] = []
    for name, ranks in by_group.items():
        if len(ranks) < 2:
            continue
        common = sorted(set.intersection(*(set(w) for w in ranks.values())))[-settings.windows:]
        if len(common) < settings.windows:
            continue
        for rank, own in ranks.items():
            gaps, walls = [], []
            for k in common:
                others = [w[k][0] for r, w in ranks.items() if r != rank]
                wall = statistics.median(w[k][1] for w in ranks.values()) / 1e9
                gap = (statistics.median(others) - own[k][0]) / 1e9
                if gap < max(settings.threshold_s, settings.fraction * wall):
                    break
                gaps.append(gap)
                walls.append(wall)
            else:
                named.append(Straggler(rank, name, sum(gaps) / len(gaps), sum(walls) / len(walls), ops[name],
                                       len(gaps), common[-1]))
    return sorted(named, key=lambda s: -s.lost_s)
