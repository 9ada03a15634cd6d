"""Build, start and stop the coordinator: a grpc.aio server run on its own event-loop thread."""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from axond.config import RuntimeEnv
from axond.control.channel import read_file
from axond.control.credentials import ensure_token, read_token_file
from axond.coordinator.service.admission import Admission, AdmissionInterceptor
from axond.coordinator.service.auth import TokenInterceptor
from axond.coordinator.service.decoding import DecodeGuard
from axond.coordinator.service.unregistered import add_unregistered
from axond.coordinator.collector import tune_for_serving
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.persistence.etcd import EtcdPersistence
from axond.coordinator.persistence.group_commit import GroupCommit
from axond.coordinator.persistence.sqlite import SqlitePersistence
from axond.coordinator.service.servicer import CoordinatorServicer
from axond.coordinator.service.stall import StallWatch
from axond.coordinator.state.machine import CoordinatorState
from axond.coordinator.service.waiting import WaitHub
from axond.errors import CoordinatorError
from axond.fencing import FENCE_MARGIN_S, RECONNECT_ALLOWANCE_S, check_fence_margin
from axond.observe.coordinator_metrics import render_coordinator
from axond.observe.dashboard.pages import Dashboard
from axond.observe.dashboard.view import read_view
from axond.observe.http import MetricsServer
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("axond.coordinator")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
MAX_MESSAGE_BYTES = 8 << 20


SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
    # gRPC core cancels (CANCELLED, at random) calls that arrive while more than 1,000 wait for the Python
    # server to pick them up (3,000: all of them); a burst of thousands of nodes registering or joining at once
    # does that. Admission control is the coordinator's own (max_concurrent_calls: RESOURCE_EXHAUSTED, retried).
    ("grpc.server.max_pending_requests", 1 << 20),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
]


@dataclass(frozen=True)
class CoordinatorConfig:
    """How to run the coordinator."""

    host: str = "0.0.0.0"
    """Interface to listen on."""
    port: int = 29500
    """TCP port; 0 lets the OS choose (tests), see RunningCoordinator.port."""
    token: str | None = None
    """Shared secret every client must send as `authorization: Bearer <token>` (health is exempt).
    None: read `token_file`, else use (or generate) `<state_dir>/token`, unless `insecure`."""
    token_file: str | None = None
    """File holding the token (instead of `token`)."""
    insecure: bool = False
    """Serve without a token: anyone who reaches the port can run jobs. Only for trusted, isolated hosts."""
    state_dir: str | None = None
    """Where the state (SQLite) and the generated token are kept; None: $AXOND_STATE_DIR,
    $XDG_STATE_HOME/axond or ~/.local/state/axond."""
    in_memory: bool = False
    """Keep nodes, jobs and stores in this process only: a restart forgets them (throw-away runs, tests)."""
    state: str | None = None
    """`etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`: keep the state in etcd and run as one of several replicas,
    one of which (elected through an etcd lease) serves while the others redirect clients to it."""
    advertise: str | None = None
    """With `state`: the HOST:PORT clients reach this replica at (told to them by the followers; default
    host:port, with this machine's name when host is a wildcard)."""
    leader_ttl: int = 3
    """With `state`: seconds of the leader's etcd lease; a dead leader is replaced within about this long."""
    fsync: bool = False
    """Flush each group commit to disk before its answers leave (survives power loss; default: survives the process
    being killed)."""
    tls_cert: str | None = None
    """PEM certificate file; with tls_key, serve TLS."""
    tls_key: str | None = None
    """PEM private-key file of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA file: require client certificates signed by it (mutual TLS; needs tls_cert)."""
    heartbeat_interval: float = 1.0
    """Seconds between node heartbeats (told to nodes)."""
    dead_after_missed: int = 5
    """Heartbeats missed before a node is declared dead."""
    settle_time: float = 0.5
    """MIN:MAX rendezvous: how long to wait after MIN nodes joined for late joiners."""
    fence_margin: float = FENCE_MARGIN_S
    """Seconds between declaring a node dead and starting its job's next generation, beyond the time its worker may
    take to kill its ranks (>= FENCE_OVERRUN_S, axond/fencing.py): no two generations of a job run at once."""
    limits: CoordinatorLimits = field(default_factory=CoordinatorLimits)
    """Bounds on everything a caller can make the coordinator hold (see coordinator/limits.py)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at http://host:PORT/metrics (0: an OS-chosen port); None: no metrics."""

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise CoordinatorError(f"port {self.port} is outside 0..65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise CoordinatorError("TLS needs both --tls-cert and --tls-key")
        if self.token is not None and not self.token:
            raise CoordinatorError("--token must not be empty (omit it to have one generated)")
        if self.insecure and (self.token or self.token_file):
            raise CoordinatorError("--insecure turns the token off: pass it or --token/--token-file, not both")
        if self.tls_client_ca and not self.tls_cert:
            raise CoordinatorError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.state is not None:
            from axond.coordinator.persistence.etcd import parse_state_url

            parse_state_url(self.state)
            if self.in_memory:
                raise CoordinatorError("--state etcd://... keeps the state in etcd: drop --in-memory")
            if not (self.token or self.token_file or self.insecure):
                raise CoordinatorError(
                    "replicas on etcd must share one token: pass the same --token-file (or --token) to each, "
                    "or --insecure"
                )
            if self.leader_ttl < 2:
                raise CoordinatorError(f"--leader-ttl {self.leader_ttl}: etcd grants no lease under 2 s")
        try:
            self.limits.validate()
        except ValueError as e:
            raise CoordinatorError(str(e)) from e
        if not self.heartbeat_interval > 0 or self.dead_after_missed < 1 or not self.settle_time >= 0:
            raise CoordinatorError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be > 0, dead_after_missed "
                f"({self.dead_after_missed}) >= 1, settle_time ({self.settle_time}) >= 0"
            )
        try:
            check_fence_margin(self.fence_margin)
        except ValueError as e:
            raise CoordinatorError(str(e)) from e


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


def _client_address(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::", "[::]"):
        return f"127.0.0.1:{port}"
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


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


def default_state_dir() -> Path:
    """The state directory of a config without one (`axond coordinator` passes its own, see `RuntimeEnv.state_dir`)."""
    return RuntimeEnv.from_env().state_dir


def resolve_server_token(config: CoordinatorConfig) -> tuple[str | None, Path | None]:
    """The token to require and the file it came from: given, from token_file, or kept in the state dir."""
    if config.insecure:
        return None, None
    if config.token:
        return config.token, None
    if config.token_file:
        return read_token_file(config.token_file), Path(config.token_file)
    return ensure_token(config.state_dir or default_state_dir())


def _credentials(config: CoordinatorConfig) -> grpc.ServerCredentials | None:
    if not (config.tls_cert and config.tls_key):
        return None
    pair = [(read_file(config.tls_key, "TLS key"), read_file(config.tls_cert, "TLS cert"))]
    if config.tls_client_ca:
        ca = read_file(config.tls_client_ca, "TLS client CA")
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


async def _serve(config: CoordinatorConfig, running_box: list[RunningCoordinator], ready: threading.Event) -> None:
    if config.state is not None:
        from axond.coordinator.replica import serve_replica

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
        await _serve_state(config, running, running_box, ready)
    finally:
        if persistence is not None:
            persistence.close()


async def _serve_state(config: CoordinatorConfig, running: RunningCoordinator, running_box: list[RunningCoordinator],
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
        creds = _credentials(config)
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
    running.port, running.address = port, _client_address(config.host, port)
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
                                            pages=Dashboard(lambda: read_view(running), running.token))
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
