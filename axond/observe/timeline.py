"""A rank's timeline: Chrome trace events (the JSON Perfetto and chrome://tracing open), one file per rank.

With `AXOND_TIMELINE=DIR` every rank writes `DIR/rank-RANK-pid-PID.json`: a JSON array of trace events, one
complete event ("ph": "X") per collective (op, group, bytes, path taken, start and duration), DDP bucket,
FSDP unit gather or reduce, and checkpoint save. Timestamps are this process's monotonic clock in
microseconds; the file's first event (`axond_clock`) pairs it with the wall clock, which `axond timeline
merge` uses to put every rank on one clock. Events are buffered and written by a background thread; the
array is closed at exit (a rank that was killed leaves it open, which the viewers and the merge accept).

`TRACER` is None when the timeline is off: callers check it once per event and do nothing else.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

FLUSH_INTERVAL_S = 0.5
"""How often buffered events are written out."""
MAIN_TID = 0
"""The thread id of training events (DDP, FSDP, checkpoints); groups get 1, 2, ... in order of first use."""


class Tracer:
    """Buffers this rank's events and writes them to its file."""

    def __init__(self, directory: str, rank: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.pid = int(rank) if rank.isdigit() else os.getpid()
        """The trace's process id: the rank (one row per rank in a viewer)."""
        self.path = Path(directory) / f"rank-{rank}-pid-{os.getpid()}.json"
        self._events: deque[tuple[Any, ...]] = deque()
        """Events not written yet (appended without a lock: deque appends and pops are atomic)."""
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._file = open(self.path, "w", buffering=1 << 16)
        wall_us, mono_us = time.time_ns() / 1000, time.perf_counter_ns() / 1000
        self._write([
            {"name": "axond_clock", "ph": "M", "pid": self.pid, "tid": MAIN_TID, "ts": 0,
             "args": {"wall_us": wall_us, "mono_us": mono_us, "host": socket.gethostname(), "rank": rank,
                      "os_pid": os.getpid()}},
            {"name": "process_name", "ph": "M", "pid": self.pid, "tid": MAIN_TID, "ts": 0,
             "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.pid, "tid": MAIN_TID, "ts": 0,
             "args": {"sort_index": self.pid}},
            {"name": "thread_name", "ph": "M", "pid": self.pid, "tid": MAIN_TID, "ts": 0, "args": {"name": "training"}},
        ], first=True)
        self._closed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="axond-timeline", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def tid(self, group: str) -> int:
        """The trace thread of group `group` (named `group NAME` in the trace)."""
        tid = self._tids.get(group)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(group, len(self._tids) + 1)
                self._events.append(("M", tid, group))
        return tid

    def complete(self, name: str, cat: str, tid: int, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        """An event from `start_ns` to `end_ns` (time.perf_counter_ns) on trace thread `tid`."""
        self._events.append(("X", name, cat, tid, start_ns, end_ns, args))

    def since(self, name: str, cat: str, start_ns: int, **args: Any) -> None:
        """A training event (DDP, FSDP, checkpoint) from `start_ns` until now."""
        self._events.append(("X", name, cat, MAIN_TID, start_ns, time.perf_counter_ns(), args))

    def _flush_loop(self) -> None:
        while not self._stopped.wait(FLUSH_INTERVAL_S):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending = self._events
            events = [pending.popleft() for _ in range(len(pending))]
            if self._closed or not events:
                return
            out = []
            pid, dumps = self.pid, json.dumps
            for e in events:
                if e[0] == "M":
                    out.append(dumps({"name": "thread_name", "ph": "M", "pid": pid, "tid": e[1], "ts": 0,
                                      "args": {"name": f"group {e[2]}"}}))
                else:  # name and cat are axond's own identifiers: only args need escaping
                    _, name, cat, tid, start, end, args = e
                    out.append(f'{{"name":"{name}","cat":"{cat}","ph":"X","pid":{pid},"tid":{tid},'
                               f'"ts":{start / 1000:.3f},"dur":{(end - start) / 1000:.3f},'
                               f'"args":{dumps(args, separators=(",", ":"))}}}')
            self._write_text(",\n".join(out))

    def _write(self, events: list[dict[str, Any]], first: bool = False) -> None:
        self._write_text(",\n".join(json.dumps(e, separators=(",", ":")) for e in events), first)

    def _write_text(self, text: str, first: bool = False) -> None:
        try:
            self._file.write(("[\n" if first else ",\n") + text)
            self._file.flush()
        except (OSError, ValueError):
            pass  # the directory went away, or the file was closed: the timeline ends here

    def close(self) -> None:
        """Write what is buffered and close the array (at exit)."""
        self._stopped.set()
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._file.write("\n]\n")
                self._file.close()
            except (OSError, ValueError):
                pass


TRACER: Tracer | None = None
"""This process's tracer, once a process group started it with AXOND_TIMELINE set; None: no timeline."""
_start_lock = threading.Lock()


def start(directory: str, rank: str | None = None) -> Tracer:
    """The process's tracer, started on first use (writing into `directory`, its file named after `rank`, else this
    process's id)."""
    global TRACER
    with _start_lock:
        if TRACER is None:
            TRACER = Tracer(directory, rank or str(os.getpid()))
        return TRACER


def span_start() -> int:
    """The start of a span, for `TRACER.complete` (time.perf_counter_ns)."""
    return time.perf_counter_ns()
