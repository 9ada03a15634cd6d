"""A `Changes` as bytes and back (JSON; KV values in base64), and the whole of `Tables` as one `Changes`.

A snapshot is the `Changes` that rebuilds the tables from nothing, so the log and the snapshot share
one format and one way to apply (`Tables.apply`).
"""

from __future__ import annotations

import base64
import json

from typing import Any

from axond.coordinator.state.port import Changes, JoinerChanges, Record
from axond.coordinator.persistence.tables import Tables


def encode(c: Changes) -> bytes:
    doc = {
        "nodes": c.nodes, "deleted_nodes": sorted(c.deleted_nodes), "jobs": c.jobs,
        "deleted_jobs": sorted(c.deleted_jobs), "cleared_stores": sorted(c.cleared_stores),
        "kv": [[job, key, gen, None if value is None else base64.b64encode(value).decode()]
               for (job, key), (gen, value) in c.kv.items()],
        "barriers": [[job, name, gen, rec] for (job, name), (gen, rec) in c.barriers.items()],
        "events": {job: [first, events] for job, (first, events) in c.events.items()},
        "meta": c.meta,
        "joiners": {job: [jc.generation, jc.reset, list(jc.rows.items())] for job, jc in c.joiners.items()},
        "past_rounds": {job: list(rounds.items()) for job, rounds in c.past_rounds.items()},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(blob: bytes) -> Changes:
    doc = json.loads(blob)
    return Changes(
        nodes=doc["nodes"], deleted_nodes=set(doc["deleted_nodes"]), jobs=doc["jobs"],
        deleted_jobs=set(doc["deleted_jobs"]), cleared_stores=set(doc["cleared_stores"]),
        kv={(job, key): (int(gen), None if value is None else base64.b64decode(value))
            for job, key, gen, value in doc["kv"]},
        barriers={(job, name): (int(gen), rec) for job, name, gen, rec in doc["barriers"]},
        events={job: (int(first), events) for job, (first, events) in doc["events"].items()},
        meta=doc["meta"],
        joiners={job: JoinerChanges(int(gen), bool(reset), dict((node_id, row) for node_id, row in rows))
                 for job, (gen, reset, rows) in doc.get("joiners", {}).items()},  # absent: an older entry
        past_rounds={job: {int(gen): rec for gen, rec in rounds} for job, rounds in doc.get("past_rounds", {}).items()},
    )


def whole(tables: Tables) -> Changes:
    """The `Changes` that, applied to empty tables, gives `tables`."""
    snap = tables.snapshot()
    return Changes(
        nodes={r["node_id"]: r for r in snap.nodes}, jobs={r["name"]: r for r in snap.jobs},
        kv={(job, key): (gen, value) for job, gen, key, value in snap.kv},
        barriers={(job, name): (gen, rec) for job, gen, name, rec in snap.barriers},
        events=dict(snap.events), meta=snap.meta,
        joiners=whole_joiners(snap.joiners),
        past_rounds=whole_past(snap.past_rounds),
    )


def whole_past(rounds: list[tuple[str, int, Record]]) -> dict[str, dict[int, Record | None]]:
    out: dict[str, dict[int, Record | None]] = {}
    for job, gen, rec in rounds:
        out.setdefault(job, {})[gen] = rec
    return out


def whole_joiners(joiners: list[tuple[str, int, str, list[Any]]]) -> dict[str, JoinerChanges]:
    """The joiner rows of a snapshot as the `Changes` that write them all."""
    out: dict[str, JoinerChanges] = {}
    for job, gen, node_id, row in joiners:
        out.setdefault(job, JoinerChanges(gen, True, {})).rows[node_id] = row
    return out
