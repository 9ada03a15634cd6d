"""`axond status` (nodes, jobs and ranks as tables) and `axond health` (for healthchecks)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from grpc_health.v1 import health_pb2

from axond.cli.common import EXIT_FAILED, EXIT_OK, LOCAL_COORDINATOR, connect_wait_option, coordinator_options_local, examples
from axond.cli.common import fail
from axond.cli.common import EXIT_USAGE, fail_coordinator, runtime_env, waiting_notice
from axond.cli.status_stacks import job_stacks
from axond.control.client import CoordinatorClient, connect
from axond.config import StragglerSettings
from axond.distributed.diagnostics.arrivals import MAX_RANKS, read_arrivals, stragglers
from axond.distributed.diagnostics.inflight import blocked_text, read_report
from axond.errors import CoordinatorError, StoreError
from axond.v1 import coordinator_pb2 as pb


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces, header first."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _enum_name(enum: object, value: int, prefix: str) -> str:
    name: str = enum.Name(value)  # type: ignore[attr-defined]
    return name.removeprefix(prefix).lower()


def render_status(status: pb.GetStatusResponse, blocked: dict[tuple[str, int], str] | None = None,
                  straggling: dict[tuple[str, int], str] | None = None) -> str:
    """The three tables of `axond status`; with `blocked` ((job, rank) -> what the rank is blocked in), a column
    for it in the ranks table, and with `straggling` ((job, rank) -> why the others wait for it), a STRAGGLER one."""
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
        (j.job, r.rank, r.node_id, r.hostname or "-", r.pid or "-", r.node_rank, r.local_rank)
        + ((straggling.get((j.job, r.rank), "-"),) if straggling is not None else ())
        + ((blocked.get((j.job, r.rank), "-"),) if blocked is not None else ())
        for j in status.jobs for r in sorted(j.ranks, key=lambda r: r.rank)
    ]
    omitted = sum(j.ranks_omitted for j in status.jobs)
    parts = [
        f"NODES ({len(nodes)})",
        format_table(("NODE", "HOST", "HEALTH", "LAST HEARTBEAT", "SLOTS", "MODE", "JOB"), nodes),
        "",
        f"JOBS ({len(jobs)})",
        format_table(("JOB", "STATE", "GENERATION", "NODES", "WORLD SIZE", "RESTARTS", "REASON"), jobs),
        "",
        f"RANKS ({len(ranks)})",
        format_table(("JOB", "RANK", "NODE", "HOST", "PID", "NODE RANK", "LOCAL RANK")
                     + (("STRAGGLER",) if straggling is not None else ())
                     + (("BLOCKED IN",) if blocked is not None else ()), ranks),
    ]
    if omitted:
        parts.append(f"{omitted} ranks not shown")
    goodput = goodput_rows(status)
    if goodput:
        parts += ["", f"GOODPUT ({len(goodput)})", format_table(GOODPUT_HEADER, goodput)]
    return "\n".join(parts)


GOODPUT_CAUSES = ("productive", "startup", "waiting_for_members", "detection", "reformation", "hung")
GOODPUT_HEADER = ("JOB", "WALL", "GOODPUT", "PRODUCTIVE", "STARTUP", "WAITING", "DETECTION", "REFORMATION", "HUNG")


def goodput_rows(status: pb.GetStatusResponse) -> list[tuple[object, ...]]:
    """Per job: its wall time, the productive share, and the seconds of each cause (they add up to the wall time)."""
    rows: list[tuple[object, ...]] = []
    for j in status.jobs:
        if not j.goodput:
            continue
        parts = {p.cause: p.seconds for p in j.goodput}
        share = parts.get("productive", 0.0) / j.wall_s if j.wall_s > 0 else 0.0
        rows.append((j.job, f"{j.wall_s:.1f}s", f"{share:.1%}", *(f"{parts.get(c, 0.0):.1f}s" for c in GOODPUT_CAUSES)))
    return rows


@click.command(
    "status",
    short_help="Show nodes, jobs and ranks as tables.",
    epilog=examples("axond status                               # the coordinator on this machine, port 29500",
                    "axond status --coordinator HOST:29500",
                    "axond status --coordinator 127.0.0.1:29500 --token-file ~/.local/state/axond/token --job my-job",
                    "axond status --job my-job --stacks         # every rank's Python stacks, on every node")
    + "Exit codes: 0 shown; 1 the coordinator refused the request; 2 usage error; 3 cannot reach or "
      "authenticate to the coordinator.",
)
@coordinator_options_local
@connect_wait_option
@click.option("--job", default="", help="Only this job (and its ranks, with the op each one is blocked in) "
                                        "[default: every job].")
@click.option("--all", "show_all", is_flag=True,
              help="Also show finished jobs and dead nodes the coordinator hides after a while.")
@click.option("--stacks", is_flag=True, help="With --job: also every rank's Python stacks (every thread), asked of "
                                             "the job's workers on every node.")
@click.option("--stacks-wait", type=click.FloatRange(min=0, min_open=True, max=600), default=5.0, show_default=True,
              help="Seconds to wait for the workers' answers to --stacks.")
@click.option("--fr-dir", default="", help="With --stacks: write the ranks' Flight Recorder dumps to this directory, "
                                          "for python -m torch.distributed.flight_recorder.fr_trace.")
def status(
    address: str | None, token: str | None, tls_ca: str | None, connect_wait: float, job: str, show_all: bool,
    stacks: bool, stacks_wait: float, fr_dir: str
) -> None:
    """Show the coordinator's nodes (with their health), jobs and ranks.

    With --job, each rank's row also says which collective it has been blocked in for a while (a quarter
    of its group timeout, at most 10 s), from the reports ranks publish in the job's store: a hung job
    shows which ranks wait in which op, and which are stuck elsewhere ("-"). A STRAGGLER column names the ranks
    the others keep waiting for (AXOND_STRAGGLER_* settings; docs/operations.md, "Stragglers"). --stacks adds
    every rank's Python stacks (every thread), which the job's workers send through the coordinator.
    """
    if stacks and not job:
        fail("status", "--stacks needs --job JOB (the job whose ranks to ask)", EXIT_USAGE)
    if fr_dir and not stacks:
        fail("status", "--fr-dir needs --stacks (the dumps come with the stacks)", EXIT_USAGE)
    address = address or LOCAL_COORDINATOR
    try:
        client = connect(address, token=token, tls_ca=tls_ca, connect_wait=connect_wait, on_wait=waiting_notice("status"),
                         env=runtime_env())
    except CoordinatorError as e:
        fail_coordinator("status", e, address)
    try:
        reply = client.get_status(job, all=show_all)
        blocked = _blocked(client, reply) if job else None
        straggling = _stragglers(client, reply, runtime_env().stragglers) if job else None
        click.echo(render_status(reply, blocked, straggling))
        if stacks:
            click.echo("\n" + job_stacks(client, reply, job, stacks_wait, blocked or {}, fr_dir))
    except CoordinatorError as e:
        fail_coordinator("status", e, address)
    except StoreError as e:
        fail("status", f"cannot ask for job {job!r}'s stacks: {e} (the job may have restarted or ended; try again)",
             EXIT_FAILED)
    except OSError as e:
        fail("status", f"cannot write the Flight Recorder dumps to --fr-dir {fr_dir!r}: {e}", EXIT_FAILED)
    finally:
        client.close()


def _blocked(client: CoordinatorClient, status: pb.GetStatusResponse) -> dict[tuple[str, int], str]:
    """(job, rank) -> what the rank reports being blocked in, for the ranks of running jobs that report one."""
    out: dict[tuple[str, int], str] = {}
    for j in status.jobs:
        if j.generation < 1:
            continue
        store = client.store(j.job, j.generation)
        for r in j.ranks:
            try:
                ops, _ = read_report(store, r.rank)
            except ValueError:
                out[(j.job, r.rank)] = "(unreadable report)"
                continue
            except StoreError:
                break  # the job's generation is gone (it restarted or ended): nothing to report
            if ops:
                out[(j.job, r.rank)] = blocked_text(ops)
    return out


def _stragglers(client: CoordinatorClient, status: pb.GetStatusResponse,
                settings: StragglerSettings) -> dict[tuple[str, int], str]:
    """(job, rank) -> why the others wait for the rank, for the ranks named stragglers from their arrival windows."""
    out: dict[tuple[str, int], str] = {}
    for j in status.jobs:
        if j.generation < 1 or j.ranks_omitted or len(j.ranks) > MAX_RANKS:
            continue
        try:
            reports = read_arrivals(client.store(j.job, j.generation), [r.rank for r in j.ranks])
        except StoreError:
            continue  # the job's generation is gone (it restarted or ended)
        for s in stragglers(reports, settings):
            out.setdefault((j.job, s.rank), s.short())
    return out


@click.command(
    "health",
    short_help="Exit 0 if the coordinator is serving.",
    epilog=examples("axond health --coordinator HOST:29500 --timeout 2    # e.g. a compose healthcheck",
                    "axond health                                         # the coordinator on this machine")
    + "Exit codes: 0 SERVING; 1 the coordinator answers anything else; 2 usage error; 3 cannot reach or "
      "authenticate to the coordinator.",
)
@coordinator_options_local
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for the answer (no retries: meant for healthchecks).")
def health(address: str | None, token: str | None, tls_ca: str | None, timeout: float) -> None:
    """Exit 0 if the coordinator answers the standard gRPC health check with SERVING."""
    address = address or LOCAL_COORDINATOR
    try:
        client = connect(address, token=token, tls_ca=tls_ca, env=runtime_env())
    except CoordinatorError as e:
        fail_coordinator("health", e, address)
    try:
        answer = client.check_health(timeout=timeout)
    except CoordinatorError as e:
        fail_coordinator("health", e, address)
    finally:
        client.close()
    if answer != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer)
        fail("health", f"the coordinator at {address} answers {name}, not SERVING (it may be shutting down)", EXIT_FAILED)
    click.echo(f"axond health: the coordinator at {address} is serving")
    sys.exit(EXIT_OK)
