"""What the control-plane benchmarks share: the coordinator they start and the token they send."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from axond.control.client import connect
from axond.coordinator.server import CoordinatorConfig, start_coordinator

COORDINATOR_PIDS: dict[str, int] = {}
"""Pid of each coordinator started in its own process, by address."""

BENCH_CONFIG = CoordinatorConfig(
    host="127.0.0.1", port=0, token="bench", heartbeat_interval=60.0, settle_time=0.0, in_memory=True
)
"""Long heartbeat interval: the simulated nodes do not heartbeat during the measurement."""
AUTH = [("authorization", f"Bearer {BENCH_CONFIG.token}")]


@contextlib.contextmanager
def coordinator(where: str, config: CoordinatorConfig = BENCH_CONFIG) -> Iterator[str]:
    """A coordinator on loopback, in this process (`thread`) or its own (`process`, its pid then in
    `COORDINATOR_PIDS[address]`); yields its address."""
    if where == "thread":
        running = start_coordinator(config)
        try:
            yield running.address
        finally:
            running.stop(grace=0.5)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = dataclasses.replace(config, port=port)
    code = f"from axond.coordinator.server import *; raise SystemExit(run_coordinator({config!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{port}"
        COORDINATOR_PIDS[address] = proc.pid
        with connect(address, token=BENCH_CONFIG.token, call_timeout=2.0) as c:
            deadline = time.monotonic() + 30.0
            while not c.health(timeout=1.0):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the benchmark coordinator did not start on port {port}")
                time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
