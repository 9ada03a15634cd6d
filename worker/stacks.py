"""A hung local rank's Python stacks, or why there are none: what the worker adds to its "still waiting" notice.

A rank that registered for it (`axond.distributed.diagnostics.stacks`: its `.stacks` file exists) is sent
`STACK_SIGNAL` and its `faulthandler` writes every thread's stack there; a process that is stopped (state T or t in
/proc/PID/stat: SIGSTOP, a debugger) cannot run its handler, and is named as stopped instead. Every wait is bounded.
"""

from __future__ import annotations

import os
import time

from axond.distributed.diagnostics.stacks import STACK_SIGNAL, STACKS_SUFFIX

STACKS_WAIT_S = 1.0
"""Longest the worker waits for a rank's stacks to be written."""

MAX_STACKS_BYTES = 64 * 1024
"""Bytes of a rank's stacks the worker reads at most."""


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z, ...), "" if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
    except OSError:
        return ""
    closing = stat.rfind(")")  # the command name may hold spaces and parentheses
    fields = stat[closing + 2:].split()
    return fields[0] if closing > 0 and fields else ""


def rank_stacks(pid: int, error_file: str, wait: float = STACKS_WAIT_S) -> str:
    """Rank process `pid`'s stacks (every thread, `faulthandler`'s text), or one line saying why there are none."""
    state = process_state(pid)
    if state in ("T", "t"):
        return f"stopped (state {state} in /proc/{pid}/stat): a stopped process runs no code, so it gives no stacks"
    if state in ("", "Z", "X"):
        return "exited"
    path = error_file + STACKS_SUFFIX
    try:
        start = os.path.getsize(path)
    except OSError:
        return "no stacks (it did not register for them: not a Python rank that imported axond)"
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError as e:
        return f"no stacks (signalling it failed: {e.strerror})"
    deadline, size, settled = time.monotonic() + wait, start, 0
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = os.path.getsize(path)
        settled = settled + 1 if now == size and now > start else 0
        size = now
        if settled >= 3:  # written and quiet for 60 ms
            break
    if size <= start:
        return f"no stacks within {wait:.1f} s (state {state} in /proc/{pid}/stat)"
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(min(size - start, MAX_STACKS_BYTES)).decode("utf-8", "replace").rstrip()
    return "its Python stacks (every thread):\n" + text
