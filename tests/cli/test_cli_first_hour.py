"""What a new user meets in the first hour: help that states the exit codes that apply, examples, `python -m
axond`, `axond status` without flags, and a --coordinator that points at some other service's port."""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from axond.cli.common import LOCAL_COORDINATOR
from axond.cli.main import main
from axond.cli.status_cmd import status
from worker_support import Procs, procs  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
GENERIC = "the job failed (a rank exited non-zero"
"""A phrase of the exit-code paragraph of the job commands (EXIT_CODES_HELP)."""


def _help(*args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--help"], prog_name="axond")
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["coordinator", "health", "status"])
def test_commands_that_run_no_job_state_their_own_exit_codes(command: str) -> None:
    text = _help(command)
    assert "Exit codes: 0" in text and GENERIC not in text, text
    assert "2 usage error" in text


def test_job_commands_keep_the_full_exit_code_paragraph() -> None:
    for command in ("worker", "run"):
        assert GENERIC in _help(command)
    assert "the job refuses" in _help("worker") and "exits 2" in _help("worker")


def test_timeline_help_has_examples() -> None:
    for args in (("timeline",), ("timeline", "merge")):
        text = _help(*args)
        assert "Examples: AXOND_TIMELINE=trace axond worker" in text and "axond timeline merge trace" in text, text


def test_coordinator_is_required_only_where_it_is() -> None:
    worker = _help("worker")
    assert "required unless --standalone" in worker and "AXOND_COORDINATOR; required]" not in worker
    assert f"default {LOCAL_COORDINATOR}" in _help("status") and f"default {LOCAL_COORDINATOR}" in _help("health")
    assert "AXOND_COORDINATOR; required]" in _help("run")


def test_status_without_a_coordinator_asks_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No --coordinator, no AXOND_COORDINATOR: 127.0.0.1:29500, never a usage error."""
    monkeypatch.delenv("AXOND_COORDINATOR", raising=False)
    result = CliRunner().invoke(status, ["--connect-timeout", "0"], prog_name="axond status")
    assert result.exit_code in (0, 3), result.output  # a coordinator of this machine answers, or none listens
    if result.exit_code == 3:
        assert f"cannot reach the coordinator at {LOCAL_COORDINATOR}" in result.output


def test_python_dash_m_axond_is_the_command_line() -> None:
    res = subprocess.run([sys.executable, "-m", "axond", "status", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: axond status [OPTIONS]")


def test_the_shared_options_table_lists_every_shared_option() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text.split("## Options every client command shares", 1)[1].split("\n\n")[2]
    for param in status.params:
        if param.name in ("address", "token", "tls_ca", "tls_cert", "tls_key", "connect_wait"):
            for opt in param.opts:
                if opt.startswith("--") and "rdzv" not in opt:
                    assert f"`{opt}" in table, f"docs/cli.md's shared-options table lacks {opt}"


@pytest.fixture
def http_port() -> Iterator[int]:
    """A plain HTTP/1.1 server on loopback: some other service's port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_port_that_does_not_speak_grpc_is_named_as_such_at_once(http_port: int, procs: Procs) -> None:
    t0 = time.monotonic()
    res = procs.run("status", "--coordinator", f"127.0.0.1:{http_port}", "--connect-timeout", "60")
    assert res.code == 3, res.stderr
    assert time.monotonic() - t0 < 50, "no wait for a coordinator that is starting: that port answered"
    assert "waiting for the coordinator" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    expected = rf"127\.0\.0\.1:{http_port} answers, but not with gRPC: is it the coordinator's port\?"
    assert re.search(expected, line), line
