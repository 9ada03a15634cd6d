"""Exec a rank's command with the parent-death signal armed: if the worker dies, even by SIGKILL, the rank
gets SIGTERM instead of running on as an orphan.

    python -S rank_exec.py WORKER_PID -- CMD ARGS...

The launcher runs this file by path (it imports nothing from axond, so it starts in milliseconds).
`prctl(PR_SET_PDEATHSIG)` is Linux-only and survives `execve`; elsewhere the command is just exec'd.
If the worker died before the signal was armed, the rank exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
EXIT_USAGE = 2
EXIT_CANNOT_START = 127
EXIT_ORPHANED = 128 + signal.SIGTERM


def arm_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: rank_exec.py WORKER_PID -- CMD ARGS...\n")
        return EXIT_USAGE
    worker, cmd = int(argv[0]), argv[2:]
    if arm_parent_death_signal(signal.SIGTERM) and os.getppid() != worker:
        return EXIT_ORPHANED
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"cannot start {cmd[0]!r}: {e.strerror or e}\n")
    return EXIT_CANNOT_START


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
