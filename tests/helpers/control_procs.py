"""Real `axond coordinator` and `axond worker` processes on loopback for the control-plane tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

AXOND = [sys.executable, "-c", "from axond.cli.main import main; main()"]
HERE = Path(__file__).resolve().parent
TOKEN = "control-test-token"


class Proc:
    """A process whose stdout and stderr go to one log file, read while it runs."""

    def __init__(self, name: str, argv: Sequence[str], logdir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def wait_for(self, needle: str, timeout: float, times: int = 1) -> None:
        """Until `needle` was printed `times` times; fails the test with the output after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(needle) >= times:
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        if self.count(needle) >= times:
            return
        pytest.fail(f"{self.name} did not print {needle!r} {times}x within {timeout} s (exit code "
                    f"{self.popen.poll()}); its output:\n{self.text()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout} s; its threads: {threads(self.popen.pid)}; "
                        f"its output:\n{self.text()}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Every process a test started, killed at its end."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.started: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, argv, self.logdir, env)
        self.started.append(p)
        return p

    def coordinator(self, name: str, port: int, *flags: str) -> Proc:
        """`axond coordinator` on 127.0.0.1:`port`, once it listens."""
        p = self.start(name, [*AXOND, "coordinator", "--host", "127.0.0.1", "--port", str(port), "--token", TOKEN,
                              *flags])
        p.wait_for("listening on", timeout=30)
        return p

    def worker(self, name: str, port: int, *flags: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        return self.start(name, [*AXOND, "worker", "--coordinator", f"127.0.0.1:{port}", "--token", TOKEN, *flags,
                                 "--", *cmd], env)

    def axond(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*AXOND, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        for proc in p.started:
            proc.kill()


def threads(pid: int) -> str:
    """What a process that does not exit is still running: each thread's name and the kernel call it waits in (and
    `py-spy dump`'s Python stacks where py-spy is installed)."""
    import shutil

    names = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            names.append(f"{(task / 'comm').read_text().strip()} ({(task / 'wchan').read_text().strip()})")
        except OSError:
            continue
    text = ", ".join(names) or "none readable"
    spy = shutil.which("py-spy")
    if spy:
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        text += "\n" + done.stdout[-8000:] + done.stderr[-500:]
    return text
