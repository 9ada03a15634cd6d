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

With AXOND_FR_DUMP_DIR set, a rank also writes its dump there by itself when one of its collectives hangs
(`HangDumps`; the threshold is `inflight.hang_after`): `<dir>/axond_fr_rank_<global rank>`, once per hang, from the
same thread, so no `axond status` call is needed and the collective's path does nothing more. A rank that cannot run
(stopped, or stuck in native code holding the GIL) writes none: the analyzer, run with `--allow-incomplete-ranks`,
names it among the ranks whose dumps are missing.

The analyzer accepts only the backend names it knows in an op's `profiling_name`: ops are written as `gloo:<op>`
(the CPU backend axond's "axond" torch backend stands in for). The format's version is `VERSION`.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Iterable
from typing import Any

VERSION = "2.10"
"""The Flight Recorder format version written (torch 2.13's analyzer reads it)."""
DUMP_SUFFIX = ".fr"
"""Appended to the rank's AXOND_ERROR_FILE: where its dump is written."""
REQUEST_SUFFIX = ".fr-request"
"""Appended to the rank's AXOND_ERROR_FILE: the file its worker touches to ask for a dump."""
FILE_PREFIX = "axond_fr_rank_"
"""The dumps' file names in a directory (AXOND_FR_DUMP_DIR, `axond status --fr-dir`): the analyzer finds the rank at
the end of each name, as in torch's own (`TORCH_FR_DUMP_TEMP_FILE` + rank)."""
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


def write_dump(directory: str, rank: int, data: bytes) -> str:
    """Write `data` as rank `rank`'s dump in `directory` (made if missing), atomically; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{FILE_PREFIX}{rank}")
    tmp = os.path.join(directory, f".axond-fr-writing-{rank}")  # a name the analyzer skips
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


Hang = frozenset[tuple[int, int]]
"""The ops a rank is hung in: (id of the group, the op's number in it: `ProcessGroup.inflight_seq`)."""


class HangDumps:
    """Writes each rank's dump to `directory` (AXOND_FR_DUMP_DIR) when one of its collectives hangs, once per hang.

    A hang starts when the rank is hung in ops none of which was part of the hang dumped last, and ends when the rank
    is hung in none: a hang that grows (a second thread's op in another group) or lasts is not written again.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._dumped: dict[int, Hang] = {}
        self._failed = False

    def check(self, rank: int, groups: Iterable[Any], hung: Hang) -> str | None:
        """Call on each look with rank `rank`'s groups and the ops it is hung in; returns the path written, if any."""
        done = self._dumped.get(rank)
        if not hung:
            self._dumped.pop(rank, None)
            return None
        if done is not None and done & hung:
            self._dumped[rank] = done | hung
            return None
        self._dumped[rank] = hung
        try:
            return write_dump(self.directory, rank, dump_bytes(groups))
        except OSError as e:
            if not self._failed:  # said once: the same directory fails alike for every hang
                self._failed = True
                print(f"axond: rank {rank}: cannot write its Flight Recorder dump to AXOND_FR_DUMP_DIR="
                      f"{self.directory!r}: {e}; make the directory writable by the ranks", file=sys.stderr)
            return None
