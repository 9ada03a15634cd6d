"""Spawn, monitor and kill the local rank processes of one job generation (no gRPC here).

Each rank runs in its own session (and so its own process group), so that stopping a rank kills
the whole tree it started. Ranks start through `rank_exec.py`, which arms the parent-death signal
(Linux) before exec'ing the command: a worker that dies, even by SIGKILL, leaves no orphan ranks.
Reader threads prefix every output line with the rank and keep stdout and stderr apart.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from axond.worker.blame import blamed, pick
from axond.worker.error_files import MAX_CAUSE_CHARS as MAX_CAUSE_CHARS
from axond.worker.error_files import TORCH_ERROR_SUFFIX as TORCH_ERROR_SUFFIX
from axond.worker.error_files import one_line, read_error_file, read_error_peer, read_error_record

OutputSink = Callable[[int, str, str], None]
"""Receives one output line: (global rank, "stdout" | "stderr", text without the newline)."""

MAX_LINE_BYTES = 64 * 1024
"""Longer output lines are split: a rank cannot make the worker buffer unbounded text."""

SPAWN_FAILED_EXIT_CODE = 127
"""Exit code recorded for a rank whose command could not be started (as a shell would)."""

RANK_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_exec.py")
"""Run by path with `python -S`: it imports nothing from axond, so it adds milliseconds to a rank's start."""

CAUSE_GRACE_S = 2.0
"""Seconds the worker waits, once a local rank failed, for the other local ranks' exits and error files, to name
the oldest failure (the root cause) rather than the first exit it saw."""

CAUSE_SETTLE_S = 0.5
"""Seconds the worker waits at least (when other local ranks still run) for an older error file to appear."""

_POLL_INTERVAL = 0.02
_print_lock = threading.Lock()


def prefixed(rank: int, text: str) -> str:
    """`[rank N] text`, or `text` as is when it already starts with torch's own prefix for that rank (`[rankN]:`,
    which torch puts on its log and traceback lines), so that no line carries two prefixes."""
    if text.startswith(f"[rank{rank}]:"):
        return text
    return f"[rank {rank}] {text}"


def print_sink(rank: int, stream: str, text: str) -> None:
    """Print a rank's line as `[rank N] text` (see `prefixed`) on the worker's own stdout or stderr."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    with _print_lock:
        out.write(prefixed(rank, text) + "\n")
        out.flush()


def exit_code_of(returncode: int) -> int:
    """Map a Popen return code to a shell-style exit code (killed by signal N => 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class RankSpec:
    """One local rank to start."""

    rank: int
    """Global rank (used in the output prefix and in failure messages)."""
    local_rank: int
    """Index of the process on this node."""
    env: Mapping[str, str]
    """Complete environment of the process."""
    error_file: str | None = None
    """Where the rank writes its uncaught exception as JSON (`AXOND_ERROR_FILE`); read if it fails."""
    pass_fds: tuple[int, ...] = ()
    """File descriptors of the worker the rank inherits (the memory it keeps for the rank: `shard_memory`)."""


@dataclass(frozen=True)
class RankExit:
    """How one local rank ended."""

    rank: int
    local_rank: int
    exit_code: int
    """Shell-style exit code: 128 + N when killed by signal N."""
    message: str = ""
    """Why it failed: the rank's uncaught exception (`Type: message`), else why it could not start, else its
    last stderr line."""
    pid: int = 0
    """Process id of the rank (0 if it never started)."""
    hostname: str = ""
    """Host the rank ran on."""
    failed_at: float = 0.0
    """When it failed (wall-clock seconds): the time in its error file, else when the worker saw it exit. The
    oldest failure is the root cause; the others are ranks that failed because of it."""
    blames: int | None = None
    """The global rank this rank failed because of, as its error file says (the peer its `DistributedError`
    names); None if it says none (see `axond.worker.blame`)."""
    reported: bool = False
    """It wrote an error file (a rank killed by a signal writes none)."""
    stopped: bool = False
    """It exited after the worker began stopping the ranks, with no error file from before: the worker ended it."""

    def describe(self) -> str:
        """One line naming the rank, where it ran, its exit code and its cause, like
        `rank 1 (host-a, pid 1234) exited with code 1: ValueError: bad input`."""
        where = ", ".join(x for x in (self.hostname, f"pid {self.pid}" if self.pid else "") if x)
        text = f"rank {self.rank}{f' ({where})' if where else ''} exited with code {self.exit_code}"
        if self.exit_code > 128:
            try:
                text += f" ({signal.Signals(self.exit_code - 128).name})"
            except ValueError:
                pass
        return f"{text}: {self.message}" if self.message else text


@dataclass(frozen=True)
class GroupResult:
    """Outcome of a set of local ranks: all exited 0, or the first one that failed."""

    exits: tuple[RankExit, ...]
    """Ranks that have exited, in the order they were seen to exit."""
    first_failure: RankExit | None

    @property
    def ok(self) -> bool:
        return self.first_failure is None


def _resolve(command: str, env: Mapping[str, str], cwd: str | None) -> str | None:
    """The executable file `command` names, found as `execvp` in the rank would find it, or None."""
    if os.sep in command:
        path = command if os.path.isabs(command) else os.path.join(cwd or os.getcwd(), command)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(command, path=env.get("PATH", os.defpath))


def _script_hint(argv: Sequence[str], cwd: str | None) -> str:
    """"; did you mean `python train.py`?" when the command is a Python script given without its interpreter."""
    script = argv[0]
    if script.endswith(".py") or os.path.isfile(os.path.join(cwd or os.getcwd(), script)):
        return f"; did you mean `python {shlex.join(argv)}`?"
    return ""


class _Rank:
    """One rank process and its two reader threads."""

    def __init__(self, spec: RankSpec, argv: Sequence[str], cwd: str | None, sink: OutputSink) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.readers: list[threading.Thread] = []
        self.spawn_error = ""
        self.last_stderr = ""
        if _resolve(argv[0], spec.env, cwd) is None:
            self.spawn_error = (f"cannot start {argv[0]!r}: no such executable file (looked in the rank's PATH"
                                f"{'' if os.sep not in argv[0] else ' and relative to ' + (cwd or os.getcwd())})"
                                f"{_script_hint(argv, cwd)}")
            return
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", RANK_EXEC, str(os.getpid()), "--", *argv],
                env=dict(spec.env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=spec.pass_fds,
            )
        except OSError as e:
            self.spawn_error = f"cannot start {argv[0]!r}: {e.strerror or e}"
            return
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            t = threading.Thread(
                target=_read_lines, args=(pipe, self.global_rank, stream,
                                          sink if stream == "stdout" else self._stderr_sink(sink)),
                name=f"axond-rank{spec.rank}-{stream}", daemon=True,
            )
            t.start()
            self.readers.append(t)

    def global_rank(self) -> int:
        """The rank's global rank now: a live re-formation renumbers the kept ranks (`live.renumber`), and its output
        lines from then on carry the new number."""
        return self.spec.rank

    def _stderr_sink(self, sink: OutputSink) -> OutputSink:
        """`sink`, remembering the last non-blank stderr line (a failed rank's cause when it wrote no error file)."""

        def remember(rank: int, stream: str, text: str) -> None:
            if text.strip():
                self.last_stderr = text
            sink(rank, stream, text)

        return remember

    def cause(self) -> str:
        """Why this rank failed, as far as the worker can tell (see `RankExit.message`)."""
        if self.spawn_error:
            return self.spawn_error
        from_file = read_error_file(self.spec.error_file)
        if from_file:
            return from_file
        for t in self.readers:  # the last lines may still be in the pipe: let the reader get them (bounded)
            t.join(timeout=0.5)
        return one_line(self.last_stderr)

    def returncode(self) -> int | None:
        if self.proc is None:
            return SPAWN_FAILED_EXIT_CODE
        rc = self.proc.poll()
        return None if rc is None else exit_code_of(rc)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the rank's whole process group (the rank and everything it started)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _read_lines(pipe: IO[bytes], rank: Callable[[], int], stream: str, sink: OutputSink) -> None:
    try:
        while True:
            raw = pipe.readline(MAX_LINE_BYTES)
            if not raw:
                break
            sink(rank(), stream, raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


class LocalRanks:
    """The running local ranks of one generation; returned by `start_ranks`."""

    def __init__(self, argv: Sequence[str], specs: Sequence[RankSpec], cwd: str | None, sink: OutputSink) -> None:
        self.hostname = socket.gethostname()
        self._ranks = [_Rank(spec, argv, cwd, sink) for spec in specs]
        self._exits: list[RankExit] = []
        self._first_failure: RankExit | None = None
        self._stopping_at: float | None = None
        """When `stop` began (wall clock): ranks exiting after it were ended by the worker."""
        self._lock = threading.Lock()

    @property
    def ranks(self) -> list[_Rank]:
        """The local ranks, in local-rank order."""
        return self._ranks

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks that started."""
        return [r.proc.pid for r in self._ranks if r.proc is not None]

    def local_pids(self) -> list[int]:
        """Pid of each local rank in local-rank order, 0 for one that is not running (what heartbeats report)."""
        return [r.proc.pid if r.proc is not None and r.proc.poll() is None else 0 for r in self._ranks]

    def exits(self) -> tuple[RankExit, ...]:
        """The ranks seen to exit so far (call `poll` to update)."""
        with self._lock:
            return tuple(self._exits)

    def poll(self) -> GroupResult | None:
        """Collect exits; return the result once every rank exited or one failed, else None."""
        with self._lock:
            seen = {e.local_rank for e in self._exits}
            for r in self._ranks:
                if r.spec.local_rank in seen:
                    continue
                code = r.returncode()
                if code is None:
                    continue
                seen_at = time.time()
                when = read_error_record(r.spec.error_file)[1] if code != 0 else None
                stopped = self._stopping_at is not None and (when is None or when >= self._stopping_at)
                ex = RankExit(
                    r.spec.rank, r.spec.local_rank, code, r.cause() if code != 0 else "",
                    pid=r.proc.pid if r.proc is not None else 0, hostname=self.hostname,
                    failed_at=min(when, seen_at) if when is not None else seen_at,
                    blames=read_error_peer(r.spec.error_file) if code != 0 else None,
                    reported=when is not None, stopped=stopped and code != 0,
                )
                self._exits.append(ex)
                if code != 0 and self._first_failure is None:
                    self._first_failure = ex
            if self._first_failure is None and len(self._exits) < len(self._ranks):
                return None
            return GroupResult(tuple(self._exits), self._first_failure)

    def root_cause(self, grace: float = CAUSE_GRACE_S) -> RankExit | None:
        """The root cause among the local ranks' failures (`axond.worker.blame.pick`), once a rank failed.

        A rank that fails because of another often exits first (the root cause may still be writing its error
        file or tearing down), so this waits up to `grace` seconds for the other ranks to exit, or for every
        still-running rank to have written no error file older than the oldest failure seen and to be blamed by no
        failure (after at least `CAUSE_SETTLE_S`: the root cause aborts its groups before it writes its file)."""
        start = time.monotonic()
        while True:
            self.poll()
            with self._lock:
                exits = list(self._exits)
            failures = [e for e in exits if e.exit_code != 0]
            if not failures:
                return None
            root = pick(exits)
            assert root is not None
            oldest = min(e.failed_at for e in failures)
            done = {e.local_rank for e in exits}
            running = [r for r in self._ranks if r.spec.local_rank not in done]
            older = [r for r in running if (read_error_record(r.spec.error_file)[1] or float("inf")) < oldest]
            accused = [r for r in running if any(blamed(f) == r.spec.rank for f in failures)]
            elapsed = time.monotonic() - start
            if (not running or elapsed >= grace
                    or (not older and not accused and elapsed >= min(CAUSE_SETTLE_S, grace))):
                return root
            time.sleep(_POLL_INTERVAL)

    def wait(self, timeout: float) -> GroupResult | None:
        """Like `poll`, waiting up to `timeout` seconds for a result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.poll()
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(_POLL_INTERVAL, left))

    def stop(self, grace: float = 5.0, reap_timeout: float = 5.0) -> None:
        """Stop every rank's process group: SIGTERM, then SIGKILL after `grace` seconds.

        Every wait is bounded; output still buffered in the pipes is drained for a short while.
        """
        self.poll()  # the exits before the stop are the ranks' own
        with self._lock:
            if self._stopping_at is None:
                self._stopping_at = time.time()
        for r in self._ranks:
            r.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.returncode() is None for r in self._ranks):
            time.sleep(_POLL_INTERVAL)
        for r in self._ranks:
            r.signal_group(signal.SIGKILL)
        for r in self._ranks:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=reap_timeout)
                except subprocess.TimeoutExpired:
                    pass
        self.poll()
        self.join_readers(timeout=1.0)

    def join_readers(self, timeout: float) -> None:
        """Wait (bounded) until the output of every rank has been passed to the sink."""
        deadline = time.monotonic() + timeout
        for r in self._ranks:
            for t in r.readers:
                t.join(timeout=max(0.0, deadline - time.monotonic()))


def start_ranks(
    argv: Sequence[str],
    specs: Sequence[RankSpec],
    cwd: str | None = None,
    sink: OutputSink = print_sink,
) -> LocalRanks:
    """Start one process of `argv` per spec, each in its own session, and return them running.

    A command that cannot be started counts as a rank that exited with code 127, so callers see
    it through the same `poll`/`wait` path as any other failure.
    """
    if not argv:
        raise ValueError("no command to run: pass it after `--`, e.g. `axond worker ... -- python train.py`")
    if not specs:
        raise ValueError("no ranks to start: nproc-per-node must be >= 1")
    return LocalRanks(argv, specs, cwd, sink)
