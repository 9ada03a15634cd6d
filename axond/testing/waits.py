"""Waits with timeouts: for rank processes (those still running when their time is up are killed), and for a
condition to hold (polled until a deadline, instead of sleeping a guessed time)."""

from __future__ import annotations

import math
import multiprocessing.process
import subprocess
import time
from collections.abc import Callable, Sequence

KILL_WAIT = 5.0
"""Seconds to wait for a killed process to be reaped."""


def join_or_kill(procs: Sequence[multiprocessing.process.BaseProcess], grace: float,
                 deadline: float = math.inf) -> None:
    """Join each process, waiting at most `grace` seconds for it and never past `deadline` (monotonic clock);
    kill those still alive."""
    for p in procs:
        p.join(max(0.0, min(grace, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(KILL_WAIT)


def communicate_all(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it exits; those still running after `timeout` (shared) are killed."""
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate(timeout=KILL_WAIT)
            outputs.append((out or "", err or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(KILL_WAIT)
    return outputs


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.01) -> None:
    """Poll `check` every `interval` seconds until it returns a true value; raise TimeoutError naming `what` if it
    has not after `timeout` seconds. Tests derive `timeout` from the lease or deadline the condition depends on."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)
