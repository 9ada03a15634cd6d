"""Shared helpers of the worker, CLI and compose tests: real `axond` subprocesses, cleaned up after.

No tests here; the worker/CLI test modules import the fixtures and helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from axond.coordinator.server import RunningCoordinator

CONTRACT_VARS = (
    "AXOND_COORDINATOR", "AXOND_JOB", "AXOND_GENERATION", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "NODE_RANK", "AXOND_JOB_SECRET", "AXOND_TOKEN", "AXOND_TLS_CA", "OMP_NUM_THREADS",
)
ENV_SCRIPT = (
    "import json, os; "
    f"print('ENV ' + json.dumps({{k: os.environ.get(k) for k in {list(CONTRACT_VARS)!r}}}))"
)
"""A rank program printing its contract environment as one `ENV {json}` line."""


def axond_argv() -> list[str]:
    """The installed `axond` console script (or the same entry point through this interpreter)."""
    script = shutil.which("axond", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [script] if script else [sys.executable, "-c", "from axond.cli.main import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FAST = dict(heartbeat_interval=0.2, dead_after_missed=15, settle_time=0.2)
"""Coordinator settings for tests: generation changes reach workers within ~0.2 s; a silent node is
dead after 3 s (not less: on a loaded 2-core machine a heartbeat can be late by a second)."""


@pytest.fixture
def coord(coordinator_factory: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    """An in-process loopback coordinator with short heartbeats (stopped by conftest's factory)."""
    return coordinator_factory(**FAST)


@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str

    def env_lines(self) -> dict[int, dict[str, str | None]]:
        """The `ENV {json}` lines printed by ENV_SCRIPT ranks, by the rank in their prefix."""
        out: dict[int, dict[str, str | None]] = {}
        for line in self.stdout.splitlines():
            if line.startswith("[rank ") and "] ENV " in line:
                prefix, payload = line.split("] ENV ", 1)
                out[int(prefix.removeprefix("[rank "))] = json.loads(payload)
        return out


class Procs:
    """Starts `axond` subprocesses in their own sessions; `close` stops every one (bounded)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def axond(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return self.start([*axond_argv(), *args], env=env)

    def start(
        self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
    ) -> subprocess.Popen[str]:
        full_env = dict(os.environ)
        for name in ("AXOND_COORDINATOR", "AXOND_TOKEN", "AXOND_TLS_CA"):
            full_env.pop(name, None)
        full_env.update(env or {})
        proc = subprocess.Popen(
            list(argv), env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True, cwd=cwd,
        )
        self.started.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> Finished:
        """Wait for `proc` and collect its output; fails the test (after killing it) on timeout."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"{proc.args} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
        return Finished(proc.returncode, out, err)

    def run(self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Finished:
        return self.finish(self.axond(*args, env=env), timeout=timeout)

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.started:
            try:
                proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.communicate(timeout=10)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    """Poll `predicate` until true; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False

def self_signed(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate and key for localhost / 127.0.0.1 in `tmp_path` (skips without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return str(cert), str(key)
