"""Serve one coordinator state over gRPC (the server's and a leading replica's): `RunningCoordinator`, the group
commit, the tick loop and the gRPC server with its interceptors."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from axond.coordinator.config import SERVER_OPTIONS, SERVICE_NAME, CoordinatorConfig, client_address, server_credentials
from axond.coordinator.persistence.etcd import EtcdPersistence
from axond.coordinator.persistence.group_commit import GroupCommit
from axond.coordinator.service.admission import Admission, AdmissionInterceptor
from axond.coordinator.service.auth import TokenInterceptor
from axond.coordinator.service.decoding import DecodeGuard
from axond.coordinator.service.servicer import CoordinatorServicer
from axond.coordinator.service.stall import StallWatch
from axond.coordinator.service.unregistered import add_unregistered
from axond.coordinator.service.waiting import WaitHub
from axond.coordinator.state.machine import CoordinatorState
from axond.errors import CoordinatorError
from axond.fencing import RECONNECT_ALLOWANCE_S
from axond.observe.http import MetricsServer
from axond.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("axond.coordinator")


class RunningCoordinator:
    """A started coordinator: its bound port, a client address, and stop/wait."""

    def __init__(
        self, port: int, address: str, state: CoordinatorState, token: str | None = None,
        token_path: Path | None = None,
    ) -> None:
        self.port = port
        self.address = address
        self.state = state
        self.token = token
        """The token clients must send (None: --insecure)."""
        self.token_path = token_path
        """The file the token was read from or generated into (None if it was given directly)."""
        self.state_dir: Path | None = None
        """Where the state is kept durably (None: in memory only)."""
        self.commits: GroupCommit | None = None
        """The durable state's group committer (None: in memory only)."""
        self.admission: Admission | None = None
        """Counts the calls running per client and pool (set once serving)."""
        self.stalls: StallWatch | None = None
        """Detects the server's own stalls and re-arms the leases (set once serving)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_request: asyncio.Event | None = None
        self._grace = 1.0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.metrics: MetricsServer | None = None
        """The /metrics server (CoordinatorConfig.metrics_port), or None."""

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get `grace` seconds) and wait for the server thread."""
        self._grace = grace
        if self.metrics is not None:
            self.metrics.stop()
        loop, request = self._loop, self._stop_request
        if loop is not None and request is not None and not self._stopped.is_set():
            try:
                loop.call_soon_threadsafe(request.set)
            except RuntimeError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(grace + 10.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stopped; returns False if `timeout` passed first."""
        return self._stopped.wait(timeout)

async def _tick_loop(state: CoordinatorState, hub: WaitHub, max_sleep: float, stalls: StallWatch,
                     commits: GroupCommit | None) -> None:
    last = time.monotonic()
    while True:
        now = time.monotonic()
        stalls.observe(now)
        if commits is not None and commits.failed is not None:
            # Not serving (its state cannot be written): heartbeats are turned away, so the time counts against
            # no lease, and nothing is declared dead until it serves again.
            state.rearm_leases(now - last, now)
            last = now
            await hub.wait([("timer",)], max_sleep)
            continue
        last = now
        try:
            nxt = state.tick(now)
        except Exception:
            log.exception("coordinator tick failed")
            nxt = None
        sleep = max_sleep if nxt is None else min(max_sleep, max(0.0, nxt - now) + 0.001)
        await hub.wait([("timer",)], sleep)


async def serve_state(config: CoordinatorConfig, running: RunningCoordinator, running_box: list[RunningCoordinator],
                       ready: threading.Event, on_commit_failure: Callable[[], None] | None = None,
                       gates: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
    """Serve `running.state` until its stop is requested; `on_commit_failure` is told when a commit fails;
    `gates` see every call before the token check (a replica's leadership check)."""
    loop = asyncio.get_running_loop()
    state = running.state
    health_servicer = health.aio.HealthServicer()
    commits = None
    if state.persistence is not None:
        def not_serving() -> None:
            for name in ("", SERVICE_NAME):
                loop.create_task(health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
            if on_commit_failure is not None:
                on_commit_failure()

        def serving_again() -> None:
            for name in ("", SERVICE_NAME):
                loop.create_task(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))

        remote = isinstance(state.persistence, EtcdPersistence)  # a network round trip: written off the loop
        commits = GroupCommit(state, state.persistence, loop, config.limits.max_commit_batch,
                              config.limits.commit_timeout_s, writer_thread=config.fsync or remote,
                              on_failure=not_serving, on_recover=serving_again, retry_failed=not remote)
        commits.start()
        running.commits = commits
    try:
        await _serve_grpc(config, running, running_box, ready, health_servicer, commits, gates)
    finally:
        if commits is not None:
            await commits.stop()


async def _serve_grpc(config: CoordinatorConfig, running: RunningCoordinator, running_box: list[RunningCoordinator],
                      ready: threading.Event, health_servicer: health.aio.HealthServicer,
                      commits: GroupCommit | None, gates: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
    loop = asyncio.get_running_loop()
    hub = WaitHub(loop)
    state = running.state
    state.listen(hub.notify)
    interceptors: list[grpc.aio.ServerInterceptor] = list(gates)
    if running.token:
        interceptors.append(TokenInterceptor(running.token))
    interceptors.append(DecodeGuard())
    running.admission = Admission(config.limits)
    interceptors.append(AdmissionInterceptor(running.admission))
    limits = config.limits
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS,  # gRPC's own cap: a backstop
                             maximum_concurrent_rpcs=limits.max_concurrent_calls + limits.max_liveness_calls + 1_000)
    tick = min(0.25, config.heartbeat_interval / 2)
    stalls = StallWatch(state, tick, quiet=min(0.5, config.heartbeat_interval))
    running.stalls = stalls
    servicer = CoordinatorServicer(state, hub, commits, stalls)
    add_unregistered(pb_grpc.add_CoordinatorServicer_to_server, servicer, server)  # (why: unregistered.py)
    add_unregistered(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bind = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    try:
        creds = server_credentials(config)
        if creds is not None:
            port = server.add_secure_port(bind, creds)
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise CoordinatorError(f"cannot listen on {bind}: {e}; is another coordinator using the port?") from e
    if port == 0:
        raise CoordinatorError(f"cannot listen on {bind}; is another coordinator using the port?")
    await server.start()
    # Leases start now, whatever the time since the state was saved or loaded: nodes kept running while the
    # coordinator was away, and their clients may take a reconnect backoff to find it again.
    state.rearm_leases(float("inf"), time.monotonic() + RECONNECT_ALLOWANCE_S)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running.port, running.address = port, client_address(config.host, port)
    running._loop = loop
    running._stop_request = running._stop_request or asyncio.Event()
    running_box.append(running)
    ticker = asyncio.create_task(_tick_loop(state, hub, tick, stalls, commits))
    ready.set()
    try:
        await running._stop_request.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        ticker.cancel()
        await server.stop(running._grace)
