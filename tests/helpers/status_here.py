"""`axond status` run inside the test process (click's runner), for tests that poll it until a condition holds: an
interpreter per look (about a CPU-second each) would compete with the job's ranks for the cores. Such a test then
runs the real command once, in its own process, and asserts on that."""

from __future__ import annotations

from click.testing import CliRunner

from axond.cli.main import main


def status_here(*args: str) -> tuple[int, str]:
    """`axond status ARGS` in this process: its exit code and standard output."""
    result = CliRunner().invoke(main, ["status", *args])
    return result.exit_code, result.stdout
