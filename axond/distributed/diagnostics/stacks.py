"""A rank's Python stacks on request: its worker sends `STACK_SIGNAL`, `faulthandler` writes every thread's stack.

A rank that `axond worker` launched (AXOND_ERROR_FILE set) registers, at import, `faulthandler` on `STACK_SIGNAL`
writing to `<error file>.stacks`; the file's existence tells the worker the handler is there (a process without it
would die of the signal, so the worker never signals one that did not create the file). faulthandler writes from
its C signal handler, so a rank stuck in Python code, in a C call that holds the GIL, or blocked in a socket answers;
a stopped process (SIGSTOP, a debugger) runs nothing, and its worker says so from /proc instead
(`axond.worker.stacks`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
from typing import IO

STACKS_SUFFIX = ".stacks"
"""Appended to the rank's AXOND_ERROR_FILE: where its stacks are written."""

STACK_SIGNAL = signal.SIGUSR2
"""The signal a rank's worker sends for its stacks."""

_file: IO[str] | None = None


def install(error_file: str) -> None:
    """Have `STACK_SIGNAL` write every thread's stack to `error_file + STACKS_SUFFIX` (once; best effort: a rank whose
    directory cannot be written to just has no stacks to give)."""
    global _file
    if _file is not None or not hasattr(faulthandler, "register"):
        return
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        f = open(error_file + STACKS_SUFFIX, "w", encoding="utf-8")  # kept open: the handler writes to it
        try:
            faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError):
            f.close()
            raise
        _file = f
