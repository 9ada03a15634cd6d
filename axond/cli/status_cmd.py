"""`axond status` (nodes, jobs and ranks as tables) and `axond health` (for healthchecks)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from axond.cli.common import EXIT_FAILED, EXIT_OK, coordinator_options, fail, fail_coordinator
from axond.control.client import connect
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces, header first."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _enum_name(enum: object, value: int, prefix: str) -> str:
    name: str = enum.Name(value)  # type: ignore[attr-defined]
    return name.removeprefix(prefix).lower()


def render_status(status: pb.GetStatusResponse) -> str:
    """The three tables of `axond status`."""
    nodes = [
        (n.node_id, n.hostname, _enum_name(pb.NodeHealth, n.health, "NODE_HEALTH_"),
         f"{n.last_heartbeat_age_s:.1f}s", n.slots, "daemon" if n.daemon else "agent", n.job or "-")
        for n in status.nodes
    ]
    jobs = [
        (j.job, _enum_name(pb.JobState, j.state, "JOB_STATE_"), j.generation, j.nnodes, j.world_size,
         f"{j.restarts}/{j.max_restarts}", j.reason or "-")
        for j in status.jobs
    ]
    ranks = [
        (j.job, r.rank, r.node_id, r.node_rank, r.local_rank)
        for j in status.jobs for r in sorted(j.ranks, key=lambda r: r.rank)
    ]
    parts = [
        f"NODES ({len(nodes)})",
        format_table(("NODE", "HOST", "HEALTH", "LAST HEARTBEAT", "SLOTS", "MODE", "JOB"), nodes),
        "",
        f"JOBS ({len(jobs)})",
        format_table(("JOB", "STATE", "GENERATION", "NODES", "WORLD SIZE", "RESTARTS", "REASON"), jobs),
        "",
        f"RANKS ({len(ranks)})",
        format_table(("JOB", "RANK", "NODE", "NODE RANK", "LOCAL RANK"), ranks),
    ]
    return "\n".join(parts)


@click.command(
    "status",
    short_help="Show nodes, jobs and ranks as tables.",
    epilog="Exit code: 0, or 3 if the coordinator could not be reached or refused the token.",
)
@coordinator_options
@click.option("--job", default="", help="Only this job (and its ranks) [default: every job].")
def status(address: str, token: str | None, tls_ca: str | None, job: str) -> None:
    """Show the coordinator's nodes (with their health), jobs and ranks."""
    try:
        client = connect(address, token=token, tls_ca=tls_ca)
    except CoordinatorError as e:
        fail_coordinator("status", e, address)
    try:
        reply = client.get_status(job)
    except CoordinatorError as e:
        fail_coordinator("status", e, address)
    finally:
        client.close()
    click.echo(render_status(reply))


@click.command(
    "health",
    short_help="Exit 0 if the coordinator is serving.",
    epilog="Exit code: 0 if the coordinator answers SERVING, 1 otherwise (unreachable too).",
)
@coordinator_options
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for the answer.")
def health(address: str, token: str | None, tls_ca: str | None, timeout: float) -> None:
    """Exit 0 if the coordinator answers the standard gRPC health check with SERVING."""
    try:
        client = connect(address, token=token, tls_ca=tls_ca)
    except CoordinatorError as e:
        fail("health", f"{e}", EXIT_FAILED)
    try:
        serving = client.health(timeout=timeout)
    except CoordinatorError as e:
        fail("health", f"the coordinator at {address} is not healthy: {e}", EXIT_FAILED)
    finally:
        client.close()
    if not serving:
        fail("health", f"the coordinator at {address} is not serving: is `axond coordinator` running at {address}?",
             EXIT_FAILED)
    click.echo(f"axond health: the coordinator at {address} is serving")
    sys.exit(EXIT_OK)
