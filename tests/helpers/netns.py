"""Pytest side of the namespace hosts (axond/testing/netns.py): the `netns` fixture and logged processes.

`netns(n_hosts=3, mtu=1500)` builds a `Network` that is torn down after the test whatever happened
(processes killed, namespaces and links deleted); the test is skipped, with the reason, where
namespaces cannot be built (not root, no `ip netns`). Import the fixture into a test module with
`from netns import netns`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from axond.testing.netns import Host, Network, unavailable

AXOND = [sys.executable, "-c", "from axond.cli.main import main; main()"]
"""The `axond` command, run by this interpreter (the same venv inside every namespace)."""


def base_env(home: Path, **extra: str) -> dict[str, str]:
    """A complete, explicit environment for processes in the hosts: this venv first on PATH, a private HOME."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin",
                                 "/usr/sbin", "/sbin"]),
        "HOME": str(home),
        "XDG_STATE_HOME": str(home / "state"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        **extra,
    }


class Proc:
    """A process in a host whose stdout and stderr go to one log file, read while it runs."""

    def __init__(self, host: Host, name: str, argv: Sequence[str], env: Mapping[str, str], logdir: Path) -> None:
        self.name = name
        self.host = host
        self.log = logdir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.popen = host.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> float:
        """Wall time (time.time) at which `needle` was first seen in the output; fails the test after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return time.time()
            if self.popen.poll() is not None and needle not in self.text():
                break
            time.sleep(0.05)
        pytest.fail(f"{self.name} (in host {self.host.index}) did not print {needle!r} within {timeout} s "
                    f"(exit code {self.popen.poll()}); its output:\n{self.text()}")

    def wait(self, timeout: float) -> int:
        """Exit code; fails the test (the process is killed at teardown) if it runs longer than `timeout`."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} (in host {self.host.index}) still running after {timeout} s; its output:\n"
                        f"{self.text()}")


@pytest.fixture
def netns() -> Iterator[Callable[..., Network]]:
    """`netns(n_hosts=3, mtu=1500)`: a fresh network of namespace hosts, deleted after the test."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Network] = []

    def make(n_hosts: int = 3, mtu: int = 1500) -> Network:
        net = Network.create(n_hosts, mtu)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()
