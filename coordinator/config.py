"""What the coordinator server and each replica share: `CoordinatorConfig`, the gRPC server's options and the
token, TLS and address look-ups both make their servers with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from axond.config import RuntimeEnv
from axond.control.channel import read_file
from axond.control.credentials import ensure_token, read_token_file
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.persistence.etcd import parse_state_url
from axond.errors import CoordinatorError
from axond.fencing import FENCE_MARGIN_S, check_fence_margin
from axond.v1 import coordinator_pb2 as pb

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
    timeline_dir: str = ""
    """Where the ranks write their timelines (AXOND_TIMELINE), when the coordinator can read it: the dashboard's
    download of a job's merged timeline; "": the dashboard says there is none."""

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


def client_address(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::", "[::]"):
        return f"127.0.0.1:{port}"
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


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


def server_credentials(config: CoordinatorConfig) -> grpc.ServerCredentials | None:
    if not (config.tls_cert and config.tls_key):
        return None
    pair = [(read_file(config.tls_key, "TLS key"), read_file(config.tls_cert, "TLS cert"))]
    if config.tls_client_ca:
        ca = read_file(config.tls_client_ca, "TLS client CA")
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials(pair)
