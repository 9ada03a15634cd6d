"""Build, start and stop the coordinator: a grpc.aio server run on its own event-loop thread (`serving`), or one
replica of several on etcd (`replica`); both from a `CoordinatorConfig` (`config`)."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import threading
from pathlib import Path
from types import FrameType

from axond.coordinator.collector import tune_for_serving
from axond.coordinator.config import CoordinatorConfig, default_state_dir, resolve_server_token
from axond.coordinator.persistence.sqlite import SqlitePersistence
from axond.coordinator.replica import serve_replica
from axond.coordinator.serving import RunningCoordinator, serve_state
from axond.coordinator.state.machine import CoordinatorState
from axond.errors import CoordinatorError
from axond.observe.coordinator_metrics import render_coordinator
from axond.observe.dashboard.pages import Dashboard
from axond.observe.dashboard.view import read_view
from axond.observe.http import MetricsServer

__all__ = ["CoordinatorConfig", "RunningCoordinator", "run_coordinator", "start_coordinator"]


async def _serve(config: CoordinatorConfig, running_box: list[RunningCoordinator], ready: threading.Event) -> None:
    if config.state is not None:
        await serve_replica(config, running_box, ready)
        return
    token, token_path = resolve_server_token(config)
    state_dir = Path(config.state_dir) if config.state_dir else default_state_dir()
    persistence = None if config.in_memory else SqlitePersistence(state_dir, fsync=config.fsync)
    try:
        try:
            state = CoordinatorState(
                config.heartbeat_interval, config.dead_after_missed, config.settle_time,
                fence_margin=config.fence_margin, limits=config.limits, persistence=persistence,
            )
        except (ValueError, KeyError, TypeError, sqlite3.DatabaseError) as e:
            raise CoordinatorError(
                f"the coordinator's state in {str(state_dir)!r} cannot be read ({type(e).__name__}: {e}); restore it "
                "from a backup, or move coordinator.db and its -wal and -shm files aside to start with an empty state"
            ) from e
        running = RunningCoordinator(0, "", state, token, token_path)
        running.state_dir = None if persistence is None else state_dir
        await serve_state(config, running, running_box, ready)
    finally:
        if persistence is not None:
            persistence.close()

def _thread_main(config: CoordinatorConfig, box: list[RunningCoordinator], errors: list[BaseException], ready: threading.Event) -> None:
    try:
        asyncio.run(_serve(config, box, ready))
    except BaseException as e:
        errors.append(e)
    finally:
        if box:
            box[0]._stopped.set()
        ready.set()


def start_coordinator(config: CoordinatorConfig) -> RunningCoordinator:
    """Start serving on a background thread; returns once the port is bound and SERVING."""
    config.validate()
    box: list[RunningCoordinator] = []
    errors: list[BaseException] = []
    ready = threading.Event()
    thread = threading.Thread(target=_thread_main, args=(config, box, errors, ready), name="axond-coordinator", daemon=True)
    thread.start()
    if not ready.wait(30.0):
        raise CoordinatorError(f"the coordinator did not start within 30 s on {config.host}:{config.port}")
    if errors or not box:
        thread.join(5.0)
        err = errors[0] if errors else None
        if isinstance(err, CoordinatorError):
            raise err
        raise CoordinatorError(f"the coordinator failed to start: {err!r}") from err
    running = box[0]
    running._thread = thread
    if config.metrics_port is not None:
        try:
            running.metrics = MetricsServer(config.host, config.metrics_port, lambda: render_coordinator(running),
                                            pages=Dashboard(lambda: read_view(running), running.token,
                                                            config.timeline_dir))
        except CoordinatorError:
            running.stop(grace=0.2)
            raise
    return running


def run_coordinator(config: CoordinatorConfig) -> int:
    """Serve in the foreground until SIGINT/SIGTERM; returns 0 after a clean stop, 1 if it cannot start."""
    try:
        running = start_coordinator(config)
    except CoordinatorError as e:
        print(f"axond coordinator: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    tune_for_serving()  # this process is the coordinator: its collector is ours to set (collector.py)
    scheme = ("mutual TLS" if config.tls_client_ca else "TLS") if config.tls_cert else "plaintext"
    if running.token is None:
        auth = "NO TOKEN"
    elif running.token_path is not None:
        auth = f"token required, kept in {running.token_path}"
    else:
        auth = "token required"
    kept = f"state in {running.state_dir}" if running.state_dir is not None else "state in memory only"
    if config.state is not None:
        kept = f"state in {config.state}; replica reached at {running.address}, leading or redirecting to the leader"
    print(f"axond coordinator listening on {config.host}:{running.port} ({scheme}, {auth}; {kept})", file=sys.stderr,
          flush=True)
    if running.metrics is not None:
        print(f"axond coordinator: metrics at http://{config.host}:{running.metrics.port}/metrics", file=sys.stderr,
              flush=True)
    if running.token is None:
        print(
            "axond coordinator: WARNING: --insecure: anyone who can reach this port can run commands on every "
            "`axond worker --slots` daemon, read every job's store and act as any node. Use it only on an "
            "isolated, trusted network.",
            file=sys.stderr, flush=True,
        )
    elif running.token_path is not None and not config.token_file:
        print(
            f"axond coordinator: clients on this machine find the token there; on other machines pass "
            f"--token-file (a copy of {running.token_path}) or --token",
            file=sys.stderr, flush=True,
        )
    try:
        while not stop.wait(0.5):
            if running.wait(0):
                print("axond coordinator: the server stopped unexpectedly", file=sys.stderr)
                return 1
    finally:
        running.stop(grace=1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("axond coordinator stopped", file=sys.stderr, flush=True)
    return 0
