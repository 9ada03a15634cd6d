"""Dumps that torch's Flight Recorder analyzer reads (`python -m torch.distributed.flight_recorder.fr_trace DIR`).

torch's Flight Recorder keeps, per rank, a ring of the collectives it ran and writes it as a pickle on a hang; its
analyzer loads every rank's file, pairs the collectives by group and sequence number, and names the ranks that did
not join the first collective that some ranks are stuck in. axond keeps no such ring on the data path (nothing is
allocated per call): a rank's dump holds, for every process group of the process, the group (name, global ranks)
and the collective it is in now, with its sequence number in the group (`ProcessGroup.waited_ops` + 1: the
collectives it finished, counted alike on every member). A rank stuck outside axond dumps its groups and no entry,
so the analyzer names it among the ranks missing from the others' collective.

A rank launched by `axond worker` writes its dump next to its error file (`<AXOND_ERROR_FILE>.fr`) when its worker
asks (it touches `<AXOND_ERROR_FILE>.fr-request`): from the in-flight reporter's thread, so a rank blocked in a
collective or busy in its own code answers; a stopped one cannot. `axond status --job J --stacks --fr-dir DIR`
gathers every rank's dump into DIR (`axond.distributed.diagnostics.stack_requests`).

The analyzer accepts only the backend names it knows in an op's `profiling_name`: ops are written as `gloo:<op>`
(the CPU backend axond's "axond" torch backend stands in for). The format's version is `VERSION`.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterable
from typing import Any

VERSION = "2.10"
"""The Flight Recorder format version written (torch 2.13's analyzer reads it)."""
DUMP_SUFFIX = ".fr"
"""Appended to the rank's AXOND_ERROR_FILE: where its dump is written."""
REQUEST_SUFFIX = ".fr-request"
"""Appended to the rank's AXOND_ERROR_FILE: the file its worker touches to ask for a dump."""
BACKEND_LABEL = "gloo"
P2P = frozenset({"send", "recv", "isend", "irecv"})


def entries(groups: Iterable[Any]) -> tuple[dict[str, dict[str, str]], list[dict[str, Any]]]:
    """(pg_config, entries) of `groups` (ProcessGroups) as the Flight Recorder writes them."""
    config: dict[str, dict[str, str]] = {}
    out: list[dict[str, Any]] = []
    now = time.time_ns()
    for g in groups:
        config[g.name] = {"name": g.name, "desc": "undefined", "ranks": str(list(g.ranks))}
        op = g.inflight
        if op is None or op in P2P:
            continue
        seq = int(g.waited_ops) + 1
        out.append({
            "record_id": seq, "pg_id": 0, "process_group": (g.name, "undefined"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"{BACKEND_LABEL}:{op}", "time_created_ns": now,
            "input_sizes": [[]], "output_sizes": [[]], "input_dtypes": [], "output_dtypes": [],
            "state": "started", "time_discovered_started_ns": now, "time_discovered_completed_ns": None,
            "retired": False, "timeout_ms": int(g.timeout * 1000), "is_p2p": False, "frames": [],
        })
    out.sort(key=lambda e: e["record_id"])
    return config, out


def dump_bytes(groups: Iterable[Any]) -> bytes:
    """The pickle of a dump of `groups` (only ints, strings, lists, tuples and dicts: what the analyzer loads)."""
    config, found = entries(groups)
    return pickle.dumps({"version": VERSION, "pg_config": config, "pg_status": {}, "entries": found})


class Dumper:
    """Writes the process's dump when its worker touched the request file (checked by the reporter thread)."""

    def __init__(self, error_file: str) -> None:
        self._request, self._path = error_file + REQUEST_SUFFIX, error_file + DUMP_SUFFIX
        self._seen = 0

    def check(self, groups: Iterable[Any]) -> None:
        try:
            asked = os.stat(self._request).st_mtime_ns
        except OSError:
            return
        if asked == self._seen:
            return
        self._seen = asked
        tmp = self._path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(dump_bytes(groups))
            os.replace(tmp, self._path)
        except OSError:
            pass  # the run directory went away (the worker stops): only the dump is lost
