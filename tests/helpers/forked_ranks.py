"""Ranks forked from one prepared process (torch and axond.torch imported once), each run as a script's top level
runs: an uncaught exception goes through `sys.excepthook` and exits 1, `sys.exit(n)` exits n, a signal ends the
process. The ranks rendezvous over a torch FileStore; each may leave a JSON report; the parent gets every rank's
exit code (negative: the signal) and report.

Used by the runners of tests/torch/test_torch_faults.py and tests/torch/test_torch_dcp.py, which launch one such
process per test module (python tests/helpers/<runner>.py) instead of starting torch in fresh processes for every case.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

POLL = 0.02
"""Seconds between looks at the ranks' exit status."""

RankBody = Callable[[int, int, str], Any]
"""A rank's work: (rank, world size, a directory the ranks share) -> a JSON-able report (None: no report)."""


def join(rank: int, size: int, shared: str, backend: str, timeout: float) -> None:
    """The default group over `backend`, rendezvousing over a FileStore in `shared`."""
    import axond.torch  # noqa: F401 -- registers "axond"

    store = dist.FileStore(os.path.join(shared, "store"), size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))


def describe(error: BaseException) -> dict[str, Any]:
    """What a test asks of a caught exception: its class, the classes it is an instance of, its message, and the same
    for the exceptions it was raised from."""
    chain: list[dict[str, Any]] = []
    seen: BaseException | None = error
    while seen is not None and len(chain) < 5:
        chain.append({"type": f"{type(seen).__module__}.{type(seen).__qualname__}",
                      "mro": [c.__qualname__ for c in type(seen).__mro__], "message": str(seen)[:4000]})
        seen = seen.__cause__ or seen.__context__
    return {"raised": chain, "traceback": traceback.format_exc()[-6000:]}


def _top_level(body: RankBody, rank: int, size: int, shared: str) -> int:
    """Run `body` as Python runs a script: the exit code it would end with (the report is written first)."""
    try:
        report = body(rank, size, shared)
        if report is not None:
            with open(os.path.join(shared, f"rank{rank}.json"), "w", encoding="utf-8") as f:
                json.dump(report, f)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _child(body: RankBody, rank: int, size: int, shared: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        code = _top_level(body, rank, size, shared)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(body: RankBody, size: int, deadline_s: float) -> dict[str, Any]:
    """Fork `size` ranks running `body`; wait for all (killing those alive after `deadline_s`). Returns
    {"codes": exit code per rank (negative: signal), "reports": report per rank or None, "logs": output tails,
    "seconds": how long it took, "killed": ranks killed at the deadline}."""
    shared = tempfile.mkdtemp(prefix="axond-forked-")
    sys.stdout.flush()
    sys.stderr.flush()
    began = time.monotonic()
    pids = []
    for rank in range(size):
        pid = os.fork()
        if pid == 0:
            _child(body, rank, size, shared, os.path.join(shared, f"rank{rank}.log"))
        pids.append(pid)
    codes: dict[int, int] = {}
    killed = []
    while len(codes) < size:
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
        if len(codes) < size and time.monotonic() - began > deadline_s:
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(rank)
            deadline_s = float("inf")
        time.sleep(POLL)
    result = {"codes": [codes[r] for r in range(size)], "reports": [_read_json(shared, r) for r in range(size)],
              "logs": [_tail(os.path.join(shared, f"rank{r}.log")) for r in range(size)],
              "seconds": round(time.monotonic() - began, 2), "killed": killed}
    shutil.rmtree(shared, ignore_errors=True)
    return result


def _read_json(shared: str, rank: int) -> Any:
    path = os.path.join(shared, f"rank{rank}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""
