"""A rank's error files: what it failed with, when, and because of which peer (read by `axond.worker.launcher`).

A rank launched by `axond worker` writes `{"type", "message", "time", "peer"}` as JSON to its error file
(`RankSpec.error_file`); torch's `@record` writes its own next to it (`TORCH_ERROR_SUFFIX`).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import tempfile

MAX_CAUSE_CHARS = 500
"""A failed rank's cause (error-file message or last stderr line) is cut to this length in messages."""


def read_error_file(path: str | None) -> str:
    """`Type: message` from a rank's error file (see `RankSpec.error_file`), or "" if it wrote none."""
    return read_error_record(path)[0]


TORCH_ERROR_SUFFIX = ".torchelastic"
"""Suffix of the path given to a rank as TORCHELASTIC_ERROR_FILE (torch's `record` writes there), next to its
axond error file."""


def _load(path: str) -> object:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None


def read_error_peer(path: str | None) -> int | None:
    """The global rank a rank's error file says it failed because of (`peer`), or None."""
    data = _load(path) if path else None
    peer = data.get("peer") if isinstance(data, dict) else None
    return peer if isinstance(peer, int) and not isinstance(peer, bool) and peer >= 0 else None


def read_error_record(path: str | None) -> tuple[str, float | None]:
    """(`Type: message`, the failure's wall-clock time) from a rank's error file, else from the file torch's
    `@record` wrote (TORCHELASTIC_ERROR_FILE: the message, no precise time); ("", None) if it wrote none."""
    if not path:
        return "", None
    data = _load(path)
    if not isinstance(data, dict):
        torch_data = _load(path + TORCH_ERROR_SUFFIX)
        inner = torch_data.get("message") if isinstance(torch_data, dict) else None
        text = inner.get("message") if isinstance(inner, dict) else inner
        return (one_line(str(text)), None) if text else ("", None)
    kind, message = str(data.get("type") or ""), str(data.get("message") or "")
    text = f"{kind}: {message}" if kind and message else kind or message
    when = data.get("time")
    return one_line(text), float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None


def one_line(text: str) -> str:
    """`text` on one line, cut to MAX_CAUSE_CHARS."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_CAUSE_CHARS else line[: MAX_CAUSE_CHARS - 3] + "..."


SCRATCH_PREFIX = "axond-errors-"
_SCRATCH_NAME = re.compile(re.escape(SCRATCH_PREFIX) + r"[0-9]+-[A-Za-z0-9_]{8}")
_held: dict[str, int] = {}
"""The scratch directories this process made, with the descriptor that holds each one's lock."""


def scratch_dir() -> str:
    """A private directory for a runner's error and membership files (`axond-errors-<pid>-*`), locked while
    this process holds it. A worker killed outright cannot remove its own: each new one first removes the
    ones no process holds any more (the lock goes with its holder, in any PID namespace)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{SCRATCH_PREFIX}[0-9]*-*")):
        if not _SCRATCH_NAME.fullmatch(os.path.basename(path)):
            continue  # not one of these (an older worker's has no lock: never touched)
        fd = _lock(path)
        if fd is not None:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)
    made = tempfile.mkdtemp(prefix=f".{SCRATCH_PREFIX}")  # locked before it has a name the sweep looks at
    fd = _lock(made)
    path = os.path.join(os.path.dirname(made), f"{SCRATCH_PREFIX}{os.getpid()}-{os.path.basename(made)[-8:]}")
    os.rename(made, path)
    if fd is not None:
        _held[path] = fd
    return path


def remove_scratch(path: str) -> None:
    """Remove a directory `scratch_dir` made, and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _lock(path: str) -> int | None:
    """A descriptor holding `path`'s exclusive lock, or None if another process holds it (or it is not ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid == os.getuid():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None
