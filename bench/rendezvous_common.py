"""What the control-plane benchmarks share: the coordinator they start and the token they send."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from axond.control.client import connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import CoordinatorConfig, start_coordinator

COORDINATOR_PIDS: dict[str, int] = {}
"""Pid of each coordinator started in its own process, by address."""

BENCH_CONFIG = CoordinatorConfig(
    host="127.0.0.1", port=0, token="bench", heartbeat_interval=60.0, settle_time=0.0, in_memory=True,
    limits=CoordinatorLimits(max_calls_per_address=50_000, max_liveness_calls_per_address=25_000),
)
"""Long heartbeat interval: the simulated nodes do not heartbeat during the measurement. Every simulated node
connects from 127.0.0.1, so one address may hold the whole of each pool."""
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
    imports = "from axond.coordinator.server import *; from axond.coordinator.limits import CoordinatorLimits"
    code = f"{imports}; raise SystemExit(run_coordinator({config!r}))"
    profile = os.environ.get("AXOND_BENCH_PROFILE")
    if profile:  # the coordinator's event loop under cProfile, its stats written to this file when it stops
        here = os.path.dirname(os.path.abspath(__file__))
        code = (f"import sys; sys.path.insert(0, {here!r}); from rendezvous_common import profiled; "
                f"{imports}; profiled({config!r}, {profile!r})")
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


def profiled(config: CoordinatorConfig, path: str) -> None:
    """Serve `config` until SIGTERM with cProfile on the server's event-loop thread, from start or only between a
    SIGUSR1 and a SIGUSR2 (the benchmark sends them around the phase it measures); write the stats to `path`
    (`AXOND_BENCH_PROFILE=path`; read them with `python -m pstats path`)."""
    import cProfile
    import signal
    import threading

    running = start_coordinator(config)
    try:  # as run_coordinator does (a tree without it profiles the default collector)
        from axond.coordinator.collector import tune_for_serving
        tune_for_serving()
    except ImportError:
        pass
    loop = running._loop
    assert loop is not None
    prof = cProfile.Profile()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def restart() -> None:
        prof.clear()
        prof.enable()

    signal.signal(signal.SIGUSR1, lambda signum, frame: loop.call_soon_threadsafe(restart))
    signal.signal(signal.SIGUSR2, lambda signum, frame: loop.call_soon_threadsafe(prof.disable))
    loop.call_soon_threadsafe(prof.enable)
    stop.wait()
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
    done.wait(10.0)
    prof.dump_stats(path)
    running.stop(grace=0.5)
