"""Imported first by a process under test (`python -c "import exit_threads; ..."`): when the process exits, after
its own exit handlers ran, it writes each thread still alive (the main thread aside) with its stack to the file
named by EXIT_THREADS_FILE. The interpreter stops those (daemon) threads wherever they are; one stopped inside a
gRPC call can hang the exit, so the control tests check that none is (tests/control/test_control_exit.py)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback


def _write() -> None:
    frames = sys._current_frames()
    with open(os.environ["EXIT_THREADS_FILE"], "w", encoding="utf-8") as f:
        for t in threading.enumerate():
            frame = frames.get(t.ident or 0)
            if t is not threading.main_thread() and frame is not None:
                f.write(f"== {t.name}\n{''.join(traceback.format_stack(frame))}\n")


atexit.register(_write)  # registered first: runs last, after every handler axond registers
