"""Joining the ranks' timeline files (see timeline.py) into one trace on one clock.

Each file's `axond_clock` event pairs its monotonic timestamps with the wall clock; every event is moved to
wall-clock time and the whole trace starts at its earliest event. Ranks on several hosts line up as well as
their hosts' clocks agree (NTP keeps them within about a millisecond on a LAN).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TimelineError(ValueError):
    """A timeline directory or file that cannot be merged (the message says which and why)."""


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one rank's file; a file whose rank was killed (its array left open) is accepted."""
    text = path.read_text().strip()
    if not text:
        return []
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    try:
        data = json.loads(text)
    except ValueError as e:
        raise TimelineError(f"{path} is not a timeline file (Chrome trace JSON): {e}") from e
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TimelineError(f"{path} holds no list of trace events")
    return [e for e in events if isinstance(e, dict)]


def _offset(path: Path, events: list[dict[str, Any]]) -> float:
    for e in events:
        if e.get("name") == "axond_clock" and e.get("ph") == "M":
            args = e.get("args") or {}
            return float(args["wall_us"]) - float(args["mono_us"])
    raise TimelineError(f"{path} has no axond_clock event: was it written by axond (AXOND_TIMELINE)?")


def merge(directory: str | Path) -> dict[str, Any]:
    """One trace (Chrome's JSON object format) of every rank file in `directory`."""
    root = Path(directory)
    if not root.is_dir():
        raise TimelineError(f"{root} is not a directory; pass the directory AXOND_TIMELINE named")
    files = sorted(root.glob("rank-*.json"))
    if not files:
        raise TimelineError(f"{root} holds no rank-*.json timeline files; run the job with AXOND_TIMELINE={root}")
    return merge_files(files)


def merge_files(files: list[Path]) -> dict[str, Any]:
    """One trace of these rank files (`merge`)."""
    merged: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    for path in files:
        events = read_events(path)
        offset = _offset(path, events)
        for e in events:
            if e.get("ph") == "M":
                if e.get("name") == "axond_clock":
                    ranks.append({"file": path.name, **(e.get("args") or {})})
                    continue
                merged.append(dict(e))
            else:
                moved = dict(e)
                moved["ts"] = float(e["ts"]) + offset
                merged.append(moved)
    timed = [e["ts"] for e in merged if e.get("ph") != "M"]
    origin = min(timed, default=0.0)
    for e in merged:
        if e.get("ph") != "M":
            e["ts"] = round(e["ts"] - origin, 3)
    merged.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "otherData": {"axond": {"origin_wall_us": origin, "ranks": ranks}}}


def write_merged(directory: str | Path, out: str | Path) -> tuple[int, int]:
    """Merge `directory` into the file `out`; returns (rank files, events)."""
    trace = merge(directory)
    Path(out).write_text(json.dumps(trace, separators=(",", ":")))
    return len(trace["otherData"]["axond"]["ranks"]), sum(1 for e in trace["traceEvents"] if e.get("ph") != "M")
