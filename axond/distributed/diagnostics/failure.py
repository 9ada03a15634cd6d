"""What a rank does when it fails, and how much of a distributed failure a user sees.

A rank's uncaught exception (the `sys.excepthook` that `init_process_group` installs, or a function
decorated with `record`) aborts every live group with the root cause, so that the peers' collectives
raise `DistributedError` "rank R failed: ExcType: message" at once instead of "peer closed", and it
writes the error file the worker reads (`AXOND_ERROR_FILE`, JSON: rank, type, message, traceback,
time). `concise` strips the transport's internal frames and exception chain from a `DistributedError`
reaching the user, unless `AXOND_DEBUG=1`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from axond.config import FailureSettings, RuntimeEnv
from axond.distributed.diagnostics import stacks
from axond.errors import DistributedError
from axond.distributed import default_registry as defaults

if TYPE_CHECKING:
    from axond.distributed.group_core import GroupCore

F = TypeVar("F", bound=Callable[..., Any])
MAX_MESSAGE = 2000
"""Characters of an exception's message sent to peers (the error file keeps all of it)."""


_live: weakref.WeakSet[GroupCore] = weakref.WeakSet()
"""The groups of this process that have a backend and are not destroyed: the ones a failure aborts."""
_lock = threading.Lock()
_settings = FailureSettings()
"""This process's failure reporting, as the environment `init_process_group` (or `import axond`) read gives it."""
_env_rank = -1
"""RANK of that environment: the rank an error file names before a default group exists."""
_members: dict[str, list[int]] = {}
"""The global ranks of each group this process built, by name: how an error file names a peer by its global rank."""
MAX_REMEMBERED_GROUPS = 1024
"""Groups whose members `_members` keeps at most (a process that builds more forgets the oldest)."""
_ROOT_RANK = re.compile(r"\brank (\d+) failed: ")


def configure(env: RuntimeEnv) -> None:
    """Report failures as `env` says (AXOND_DEBUG, AXOND_ERROR_FILE; RANK for the error file)."""
    global _settings, _env_rank
    _settings, _env_rank = env.failure, env.rank if env.rank is not None else -1


def track(group: GroupCore) -> None:
    """Have a failure of this process abort `group` (called when a member is built), reported as the group's
    environment says (`configure`)."""
    configure(group.options.runtime_env())
    with _lock:
        _live.add(group)
        _members[group.name] = list(group.ranks)
        while len(_members) > MAX_REMEMBERED_GROUPS:
            del _members[next(iter(_members))]


def untrack(group: GroupCore) -> None:
    """Forget `group` (called when it is destroyed)."""
    with _lock:
        _live.discard(group)


def live_groups() -> list[GroupCore]:
    """The groups of this process that have a backend and are not destroyed."""
    with _lock:
        return list(_live)


def concise(error: DistributedError) -> DistributedError:
    """`error` without its internal traceback and chained transport exceptions, so that the user's frames
    and one line are what is printed. Raise it with `from None`; with AXOND_DEBUG=1 re-raise the original."""
    error.__cause__ = None
    error.__suppress_context__ = True
    return error.with_traceback(None)


def debug() -> bool:
    """Whether AXOND_DEBUG asks for full internal tracebacks."""
    return _settings.debug


def summary(error: BaseException) -> str:
    """"ExcType: message" (just the type when the message is empty), the message cut to MAX_MESSAGE."""
    message = str(error)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def abort_groups(error: BaseException) -> None:
    """Abort every live group of this process because it fails with `error` (see `abort_group`)."""
    with _lock:
        groups = list(_live)
    for g in groups:
        abort_group(g, error)


def abort_group(group: GroupCore, error: BaseException) -> None:
    """Abort `group` because this rank fails with `error`: its peers raise with the root cause; never raises.

    A `DistributedError` carrying another rank's root cause passes that on; any other distributed error is
    this rank's view of a failure elsewhere, sent as a plain abort.
    """
    backend = group.backend
    if backend is None:
        return
    try:
        if isinstance(error, DistributedError):
            if error.root_cause is not None:
                backend.abort_failed(error.root_cause)
            else:
                backend.abort(str(error))
        else:
            backend.abort_failed(f"rank {group.global_rank} failed: {summary(error)}")
    except Exception:  # best effort: the rank is failing already
        pass


def _rank() -> int:
    group = defaults.current()
    return group.global_rank if group is not None else _env_rank


def blamed_peer(error: BaseException) -> int | None:
    """The global rank whose failure `error` is a consequence of: the rank its root cause names, else the peer a
    `DistributedError` names (mapped from its group's ranks); None for this rank's own failure."""
    if not isinstance(error, DistributedError):
        return None
    found = _ROOT_RANK.search(error.root_cause or "")
    if found is not None:
        return int(found.group(1))
    ranks = _members.get(error.group or "")
    if error.peer is None or ranks is None or not 0 <= error.peer < len(ranks):
        return None
    return ranks[error.peer]


def write_error_file(error: BaseException, path: str, when: float | None = None) -> None:
    """Write `error` as JSON {rank, type, message, traceback, time, peer} to `path`, atomically (temp file,
    rename). `peer` is the global rank this failure is a consequence of (`blamed_peer`), or null.

    `when` (default: now) is the time the failure was noticed, taken before the peers were told.
    """
    record = {
        "rank": _rank(),
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "time": time.time() if when is None else when,
        "peer": blamed_peer(error),
    }
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".axond-error-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def report(error: BaseException) -> None:
    """This process fails with `error`: abort the live groups and write the error file, once; never raises.

    Under torchrun, a failure that names another rank as its cause (`blamed_peer`) then waits
    `FailureSettings.survivor_exit_delay_s` before returning: torchrun names as root cause the first failure it
    observes, and the rank that failed first may take longer to exit than the ranks it took down (a SIGKILLed rank
    writes no error file; a rank's teardown can be slow), so survivors leave it time to be seen first (torchrun then
    stops them)."""
    when = time.time()  # before the peers hear of it: a root cause is older than the failures it causes
    try:
        if getattr(error, "_axond_reported", False):
            return
        try:
            error._axond_reported = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        abort_groups(error)
        path = _settings.error_file
        if path:
            write_error_file(error, path, when)
        delay = _settings.survivor_exit_delay_s
        if delay > 0 and blamed_peer(error) is not None:
            time.sleep(delay)  # under torchrun: let it see the root cause exit first (FailureSettings)
    except BaseException:  # a failing failure report must not hide the user's exception
        pass


class _Hook:
    """One installation of the failure hook: report the failure, then run the hook that was `sys.excepthook` when it
    was installed. A user's hook installed meanwhile that chains to an earlier installation chains to that one, whose
    report is then a no-op (`report` runs once per exception); a chain that leads back to a hook already running in
    this thread ends at `sys.__excepthook__` instead of recursing."""

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any]) -> None:
        self.previous = previous
        self._running = threading.local()

    def __call__(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if getattr(self._running, "on", False):
            sys.__excepthook__(kind, error, tb)
            return
        self._running.on = True
        try:
            report(error)
            self.previous(kind, error, tb)
        finally:
            self._running.on = False


def install() -> None:
    """Make this process's uncaught exceptions abort its groups and write the error file (idempotent).

    Chains to the hook current at the call (a user's, installed before or after, composes either way: see `_Hook`).
    Only `sys.excepthook`: an exception that ends another thread does not end the process, so it does not abort the
    groups either.
    """
    with _lock:
        if not isinstance(sys.excepthook, _Hook):
            sys.excepthook = _Hook(sys.excepthook)


def install_if_launched(env: RuntimeEnv) -> None:
    """`configure` from `env`, and `install` when the worker launched this rank (AXOND_ERROR_FILE set), so that an
    exception before `init_process_group` still reaches the error file (called at import); also have the worker's
    signal dump this rank's stacks (`stacks`)."""
    configure(env)
    if env.failure.error_file:
        install()
        stacks.install(env.failure.error_file)  # the worker may ask for this rank's stacks when it hangs


def record(fn: F) -> F:
    """Decorate a rank's main function: an exception escaping it aborts the groups with the root cause and
    writes the error file before it propagates (as the uncaught-exception hook does, for code that catches
    exceptions itself further out). `SystemExit` passes untouched."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as e:
            report(e)
            raise

    return wrapper  # type: ignore[return-value]
