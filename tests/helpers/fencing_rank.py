"""A rank of the fencing runs (tests/helpers/fencing_run.py): computes only, and says when it is alive.

It appends the wall time to FENCING_DIR/g<generation>-<host>.log every 10 ms, so that the first line is when it
started and the last when it was last alive, and its pid to g<generation>-<host>.pid first (so that the run can tell
when no rank of a generation is left to log on). With FENCING_IGNORE_TERM=1 it ignores SIGTERM (a rank that traps it to
save a checkpoint): only its worker's SIGKILL ends it, the worst case for fencing. It exits 0 after FENCING_SECONDS.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time


def main() -> int:
    if os.environ.get("FENCING_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stem = os.path.join(os.environ["FENCING_DIR"], f"g{os.environ['AXOND_GENERATION']}-{socket.gethostname()}")
    with open(f"{stem}.pid", "a") as pid:
        pid.write(f"{os.getpid()}\n")
    path = f"{stem}.log"
    end = time.monotonic() + float(os.environ.get("FENCING_SECONDS", "120"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while time.monotonic() < end:
            os.write(fd, f"{time.time():.6f}\n".encode())
            time.sleep(0.01)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
