"""`axond coordinator`: run the coordinator daemon in the foreground."""

from __future__ import annotations

import sys

import click


@click.command(
    "coordinator",
    short_help="Run the coordinator daemon (foreground).",
    epilog="Ctrl-C or SIGTERM stops it cleanly (exit code 0); exit code 1 if it cannot start.",
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
    config = CoordinatorConfig(
        host=host, port=port, token=token, tls_cert=tls_cert, tls_key=tls_key,
        heartbeat_interval=heartbeat_interval, dead_after_missed=dead_after_missed, settle_time=settle_time,
    )
    sys.exit(run_coordinator(config))
