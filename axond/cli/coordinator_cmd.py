"""`axond coordinator`: run the coordinator daemon in the foreground."""

from __future__ import annotations

import errno
import socket
import sys

import click

from axond.cli.common import EXIT_CODES_HELP, EXIT_FAILED, fail


@click.command(
    "coordinator",
    short_help="Run the coordinator daemon (foreground).",
    epilog="Ctrl-C or SIGTERM stops it cleanly (exit code 0); it exits 1 if it cannot start (port in use, "
           "unreadable TLS files). " + EXIT_CODES_HELP,
)
@click.option("--port", type=click.IntRange(0, 65535), default=29500, show_default=True, help="Port to serve on.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Interface to bind.")
@click.option("--token", envvar="AXOND_TOKEN", default=None,
              help="Shared token every client must present [env AXOND_TOKEN].")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM certificate (TLS).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key (TLS).")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Seconds between node heartbeats.")
@click.option("--dead-after-missed", type=click.IntRange(min=1), default=5, show_default=True,
              help="Missed heartbeats before a node is declared dead.")
@click.option("--settle-time", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Seconds an elastic rendezvous waits for late joiners once MIN nodes joined.")
def coordinator(
    port: int, host: str, token: str | None, tls_cert: str | None, tls_key: str | None,
    heartbeat_interval: float, dead_after_missed: int, settle_time: float,
) -> None:
    """Run the coordinator: node registry, rendezvous, KV store, jobs and status."""
    from axond.coordinator.server import CoordinatorConfig, run_coordinator

    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together: pass both to serve TLS, or neither")
    _check_port_free(host, port)
    config = CoordinatorConfig(
        host=host, port=port, token=token, tls_cert=tls_cert, tls_key=tls_key,
        heartbeat_interval=heartbeat_interval, dead_after_missed=dead_after_missed, settle_time=settle_time,
    )
    sys.exit(run_coordinator(config))


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
