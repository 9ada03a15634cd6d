"""`axond coordinator`: run the coordinator daemon in the foreground."""

from __future__ import annotations

import dataclasses
import errno
import socket
import sys
from typing import TYPE_CHECKING

import click

from axond.cli.common import EXIT_FAILED, examples, fail, runtime_env
from axond.fencing import FENCE_MARGIN_S, FENCE_OVERRUN_S, check_fence_margin

if TYPE_CHECKING:
    from axond.coordinator.limits import CoordinatorLimits


@click.command(
    "coordinator",
    short_help="Run the coordinator daemon (foreground).",
    epilog=examples("axond coordinator --port 29500                 # token generated, kept in the state dir",
                    "axond coordinator --port 29500 --token-file /etc/axond/token --state-dir /var/lib/axond")
    + "Exit codes: 0 stopped cleanly by Ctrl-C or SIGTERM; 1 it cannot start (port in use, unreadable TLS "
      "files, state it cannot open); 2 usage error.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=29500, show_default=True, help="Port to serve on.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Interface to bind.")
@click.option("--token", envvar="AXOND_TOKEN", default=None,
              help="Shared token every client must present [env AXOND_TOKEN]. Without it (and without "
              "--token-file or --insecure) a token is generated and kept in STATE_DIR/token.")
@click.option("--token-file", envvar="AXOND_TOKEN_FILE", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the token from this file [env AXOND_TOKEN_FILE].")
@click.option("--state-dir", envvar="AXOND_STATE_DIR", type=click.Path(file_okay=False), default=None,
              help="Directory for the coordinator's state (the generated token) [env AXOND_STATE_DIR; default "
              "$XDG_STATE_HOME/axond or ~/.local/state/axond].")
@click.option("--in-memory", is_flag=True, default=False,
              help="Keep nodes, jobs and stores in this process only (a restart forgets them); the default keeps "
              "them in STATE_DIR/coordinator.db so a restarted coordinator carries on.")
@click.option("--state", "state_url", envvar="AXOND_STATE", default=None, metavar="etcd://HOST:PORT[,...][/PREFIX]",
              help="Keep the state in etcd and run as one of several replicas: one leads (elected through an etcd "
              "lease), the others redirect clients to it [env AXOND_STATE]. Replicas share one --token-file.")
@click.option("--advertise", envvar="AXOND_ADVERTISE", default=None, metavar="HOST:PORT",
              help="With --state: the address clients reach this replica at [env AXOND_ADVERTISE; default "
              "HOST:PORT, this machine's name when --host is a wildcard].")
@click.option("--leader-ttl", type=click.IntRange(min=2), default=3, show_default=True,
              help="With --state: seconds of the leader's etcd lease (a dead leader is replaced within about this).")
@click.option("--fsync", is_flag=True, default=False,
              help="Flush every change to disk before answering (survives power loss; slower). Without it a change "
              "survives the coordinator being killed.")
@click.option("--insecure", is_flag=True, default=False,
              help="Serve without any token: anyone who reaches the port can run commands on the worker daemons. "
              "Only for isolated, trusted networks.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM certificate (TLS).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key (TLS).")
@click.option("--tls-client-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM CA: require client certificates signed by it (mutual TLS; needs --tls-cert/--tls-key).")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Seconds between node heartbeats.")
@click.option("--dead-after-missed", type=click.IntRange(min=1), default=5, show_default=True,
              help="Missed heartbeats before a node is declared dead.")
@click.option("--limit", "limits", multiple=True, metavar="NAME=VALUE",
              help="Set one coordinator limit, e.g. --limit max_jobs=500 (repeatable; the names and defaults are "
              "in the Security page of the docs).")
@click.option("--settle-time", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Seconds an elastic rendezvous waits for late joiners once MIN nodes joined.")
@click.option("--fence-margin", type=float, default=FENCE_MARGIN_S, show_default=True,
              help=f"Seconds between declaring a node dead and starting its job's next generation, beyond the time "
              f"its worker may take to kill its ranks (>= {FENCE_OVERRUN_S}): no two generations run at once.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="AXOND_METRICS_PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (nodes, jobs, rendezvous, KV ops).")
def coordinator(
    port: int, host: str, token: str | None, token_file: str | None, state_dir: str | None, in_memory: bool,
    state_url: str | None, advertise: str | None, leader_ttl: int, fsync: bool, insecure: bool,
    tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None,
    heartbeat_interval: float, dead_after_missed: int, limits: tuple[str, ...], settle_time: float,
    fence_margin: float, metrics_port: int | None,
) -> None:
    """Run the coordinator: node registry, rendezvous, KV store, jobs and status."""
    from axond.coordinator.server import CoordinatorConfig, run_coordinator

    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together: pass both to serve TLS, or neither")
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if insecure and (token or token_file):
        raise click.UsageError("--insecure serves without a token: drop it, or drop --token/--token-file")
    if state_url is not None and in_memory:
        raise click.UsageError("--state etcd://... keeps the state in etcd: drop --in-memory")
    if state_url is not None and not (token or token_file or insecure):
        raise click.UsageError("replicas on etcd share one token: pass the same --token-file (or --token) to each")
    if (advertise or leader_ttl != 3) and state_url is None:
        raise click.UsageError("--advertise and --leader-ttl are for replicas: pass --state etcd://HOST:2379 too")
    try:
        check_fence_margin(fence_margin)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--fence-margin") from e
    _check_port_free(host, port)
    config = CoordinatorConfig(
        limits=parse_limits(limits),
        host=host, port=port, token=token, token_file=token_file, state_dir=state_dir or str(runtime_env().state_dir),
        in_memory=in_memory, fsync=fsync,
        state=state_url, advertise=advertise, leader_ttl=leader_ttl,
        insecure=insecure,
        tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca,
        heartbeat_interval=heartbeat_interval, dead_after_missed=dead_after_missed, settle_time=settle_time,
        fence_margin=fence_margin, metrics_port=metrics_port,
        timeline_dir=runtime_env().observe.timeline_dir,
    )
    sys.exit(run_coordinator(config))


def parse_limits(items: tuple[str, ...]) -> CoordinatorLimits:
    """`NAME=VALUE` pairs over the defaults; a usage error names what is wrong."""
    from axond.coordinator.limits import CoordinatorLimits

    types = {f.name: f.type for f in dataclasses.fields(CoordinatorLimits)}
    values: dict[str, float | int] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in types:
            raise click.UsageError(f"--limit {item!r}: use NAME=VALUE with NAME one of {', '.join(sorted(types))}")
        try:
            values[name] = float(raw) if types[name] in (float, "float") else int(raw.replace("_", ""))
        except ValueError as e:
            raise click.UsageError(f"--limit {item!r}: {raw!r} is not a number") from e
    limits = CoordinatorLimits(**values)  # type: ignore[arg-type]
    try:
        limits.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    return limits


def _check_port_free(host: str, port: int) -> None:
    """Fail with one clear line if something listens on host:port already (gRPC would log its own
    C-core error lines and a vaguer message)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail("coordinator", f"cannot listen on {host}:{port}: {e.strerror}; pass --host as an address of this machine",
             EXIT_FAILED)
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            probe.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                fail("coordinator", f"cannot listen on {host}:{port}: the port is in use (another coordinator?); "
                                    "stop that process or pass another --port", EXIT_FAILED)
            if e.errno == errno.EADDRNOTAVAIL:
                fail("coordinator", f"cannot listen on {host}:{port}: {host} is not an address of this machine",
                     EXIT_FAILED)
