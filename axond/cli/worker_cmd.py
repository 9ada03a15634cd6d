"""`axond worker`: the agent (with a command) or the daemon (without one)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
import threading
from types import FrameType

import click
from click.core import ParameterSource

from axond.cli.common import EXIT_CODES_HELP, EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_USAGE
from axond.cli.common import connect_wait_option
from axond.cli.common import coordinator_options_torchrun, error_kind, examples, fail, fail_coordinator, need_address
from axond.cli.common import server_detail
from axond.cli.common import runtime_env, waiting_notice
from axond.config import RuntimeEnv
from axond.errors import CoordinatorError
from axond.observe.settings import METRICS_DIR_ENV
from axond.observe.worker_metrics import WorkerMetrics
from axond.worker.agent import JobOutcome
from axond.worker.node import start_agent
from axond.worker.daemon import DaemonConfig, start_daemon
from axond.worker.spec import DEFAULT_OUTAGE_GRACE_S, ConnectOptions, JobSpec, parse_nnodes

_AGENT_ONLY = ("nnodes", "nproc_per_node", "job", "max_restarts", "node_rank", "live_recovery")
_NOT_STANDALONE = ("address", "token", "tls_ca")


class _Signals:
    """Records SIGINT/SIGTERM so the main thread can stop the ranks cleanly (bounded waits)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.event = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        self.event.set()


@click.command(
    "worker",
    short_help="Run a job's ranks on this node, or serve submitted jobs (daemon).",
    context_settings={"allow_interspersed_args": False},
    epilog=examples(
        "axond worker --standalone --nproc-per-node 2 -- python train.py        # one machine, no coordinator",
        "axond worker --coordinator HOST:29500 --nnodes 2 --nproc-per-node 4 --job run1 -- python train.py",
        "axond worker --coordinator HOST:29500 --slots 8                        # daemon for `axond run`",
        "axond worker --rdzv_endpoint HOST:29500 --nnodes 2 --nproc_per_node 4 -- python train.py  # torchrun's names",
    ) + (
        "With CMD: join job NAME, start --nproc-per-node ranks of CMD and exit 0 only if every rank of the job "
        "exited 0; if one failed (here or on another node), exit 1 with a last line naming it, its host and "
        "pid, its exit code and its error. --standalone: a one-machine job with its own coordinator "
        "(no `axond coordinator` needed). Without CMD: daemon mode, running the ranks of jobs submitted "
        "with `axond run`. A worker the job refuses (it runs with other --nnodes or --max-restarts, or with all its "
        "nodes) exits 2 saying why. " + EXIT_CODES_HELP
    ),
)
@coordinator_options_torchrun
@connect_wait_option
@click.option("--standalone", is_flag=True,
              help="Run a one-machine job: start an in-process coordinator on 127.0.0.1 (random port and "
                   "token) for it and stop it at the end; no --coordinator.")
@click.option("--nnodes", default="1", show_default=True, metavar="N|MIN:MAX",
              help="Nodes in the job: exactly N, or elastic between MIN and MAX.")
@click.option("--nproc-per-node", "--nproc_per_node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rank processes to start on this node.")
@click.option("--job", "--rdzv-id", "--rdzv_id", "job", default="default", show_default=True,
              help="Name of the job to join (torchrun's --rdzv-id; also its TORCHELASTIC_RUN_ID).")
@click.option("--max-restarts", "--max_restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failure anywhere.")
@click.option("--live-recovery", is_flag=True, default=False,
              help="When a node's rank fails and at least MIN of --nnodes nodes are left, go on without it: the other "
                   "nodes' ranks keep running and re-form (axond.MembershipChanged, axond.reform(); "
                   "docs/live-recovery.md). Every worker of the job passes it.")
@click.option("--node-rank", "--node_rank", "node_rank", type=click.IntRange(min=0), default=None,
              help="Accepted for torchrun's command lines and checked against the rank the rendezvous assigns "
                   "(axond orders nodes by host name; it does not take a node rank from the command line).")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Daemon mode (no CMD): rank processes this node offers [default: 1].")
@click.option("--join-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the rendezvous to complete.")
@click.option("--stop-grace", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping ranks (a node that lost its lease: at most "
                   "what is left of it).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, envvar="AXOND_WORKER_METRICS_PORT",
              help="Serve the local ranks' collective metrics (Prometheus) at http://HOST:PORT/metrics "
                   "(HOST: --metrics-host).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, envvar="AXOND_WORKER_METRICS_HOST",
              help="Interface the metrics endpoint binds (it has no token: 0.0.0.0 only where the network is "
                   "trusted, e.g. for a Prometheus in the same cluster).")
@click.option("--outage-grace", type=click.FloatRange(min=0), default=DEFAULT_OUTAGE_GRACE_S, show_default=True,
              help="Seconds the ranks keep running while the coordinator does not answer (stopped, restarting, "
                   "failing over), as the job's other nodes vouch; a node cut off from it, or alone in its job, "
                   "stops at the lease.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, metavar="[-- CMD ARGS...]")
@click.pass_context
def worker(
    ctx: click.Context, address: str | None, token: str | None, tls_ca: str | None, connect_wait: float,
    standalone: bool, nnodes: str, nproc_per_node: int, job: str, max_restarts: int, live_recovery: bool,
    node_rank: int | None,
    slots: int | None, join_timeout: float, stop_grace: float, metrics_port: int | None, metrics_host: str,
    outage_grace: float, cmd: tuple[str, ...],
) -> None:
    """Run ranks of a job on this node (agent), or wait for submitted jobs (daemon)."""
    env = runtime_env()
    if metrics_port is not None:
        env = runtime_env(**{METRICS_DIR_ENV: _serve_metrics(metrics_host, metrics_port)})  # where the ranks report
    if standalone:
        _check_standalone(ctx, cmd, nnodes, slots)
    else:
        address = need_address(address, "; or run a one-machine job with its own coordinator: "
                                         "`axond worker --standalone --nproc-per-node K -- CMD`")
    conn = ConnectOptions(address or "", token=token, tls_ca=tls_ca, connect_wait=connect_wait,
                          on_wait=waiting_notice("worker"), env=env)
    if not cmd:
        given = [p for p in _AGENT_ONLY if ctx.get_parameter_source(p) is not ParameterSource.DEFAULT]
        if given:
            flags = ", ".join("--" + p.replace("_", "-") for p in given)
            raise click.UsageError(
                f"{flags} only apply with a command (`axond worker ... -- CMD`); in daemon mode "
                "the job's shape comes from `axond run`"
            )
        _run_daemon(conn, DaemonConfig(slots=slots or 1, stop_grace=stop_grace, join_timeout=join_timeout,
                                        outage_grace=outage_grace))
        return
    if slots is not None:
        raise click.UsageError("--slots is for daemon mode (no CMD); with a command use --nproc-per-node")
    try:
        lo, hi = parse_nnodes(nnodes)
        spec = JobSpec(
            argv=cmd, job=job, nproc_per_node=nproc_per_node, min_nodes=lo, max_nodes=hi,
            max_restarts=max_restarts, join_timeout=join_timeout, stop_grace=stop_grace, node_rank=node_rank,
            outage_grace=outage_grace, live_recovery=live_recovery,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if standalone:
        _run_standalone(spec, env)
    else:
        _run_agent(conn, spec)


def _serve_metrics(host: str, port: int) -> str:
    """Serve the ranks' metrics until this process exits; the directory they report into (AXOND_METRICS_DIR)."""
    import atexit

    try:
        metrics = WorkerMetrics(host, port)
    except CoordinatorError as e:
        fail("worker", str(e), EXIT_FAILED)
    atexit.register(metrics.stop)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"axond worker: metrics at http://{shown}:{metrics.port}/metrics", err=True)
    return str(metrics.directory)


def _check_standalone(ctx: click.Context, cmd: tuple[str, ...], nnodes: str, slots: int | None) -> None:
    """Usage errors for flags that make no sense with --standalone."""
    given = [p for p in _NOT_STANDALONE if ctx.get_parameter_source(p) is ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join("--" + ("coordinator" if p == "address" else p.replace("_", "-")) for p in given)
        raise click.UsageError(f"--standalone runs its own coordinator: drop {flags}")
    if not cmd or slots is not None:
        raise click.UsageError("--standalone runs one job: pass its command after `--` (and no --slots)")
    if nnodes != "1":
        raise click.UsageError("--standalone runs a one-machine job: drop --nnodes (or start `axond coordinator` "
                               "and one `axond worker --coordinator HOST:PORT` per machine)")


def _run_standalone(spec: JobSpec, env: RuntimeEnv) -> None:
    """Run `spec` against an in-process coordinator on loopback that lives as long as this command."""
    from axond.coordinator.server import CoordinatorConfig, start_coordinator

    token = secrets.token_hex(16)
    private = tempfile.mkdtemp(prefix="axond-standalone-")  # 0700: only this user reads the token
    token_file = os.path.join(private, "token")
    try:
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token + "\n")
        try:
            coordinator = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, token=token, in_memory=True))
        except CoordinatorError as e:
            fail("worker", f"--standalone could not start its coordinator: {e}", EXIT_FAILED)
        try:
            click.echo(f"axond worker: --standalone coordinator at {coordinator.address} (token in {token_file}, "
                       "both gone when this job ends); see the job with: axond status --coordinator "
                       f"{coordinator.address} --token-file {token_file} --job {spec.job}", err=True)
            _run_agent(ConnectOptions(coordinator.address, token=token, env=env), spec)
        finally:
            coordinator.stop(grace=0.5)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _run_agent(conn: ConnectOptions, spec: JobSpec) -> None:
    signals = _Signals()
    try:
        agent = start_agent(conn, spec)
    except CoordinatorError as e:
        fail_coordinator("worker", e, conn.address)
    outcome: JobOutcome | None = None
    while outcome is None:
        outcome = agent.wait(0.2)
        if outcome is None and signals.received is not None:
            name = signal.Signals(signals.received).name
            outcome = agent.stop(128 + signals.received, f"stopped by {name}") or JobOutcome(128 + signals.received)
    if outcome.refused and outcome.error is not None:
        detail = server_detail(outcome.error) or str(outcome.error)
        fail("worker", f"job {spec.job!r} refused this worker: {detail}", EXIT_USAGE)
    if outcome.exit_code != 0:
        why = outcome.message or f"exit code {outcome.exit_code}"
        if outcome.error is not None and error_kind(outcome.error) == "DEADLINE_EXCEEDED":
            why = server_detail(outcome.error) or why  # the coordinator says who joined and what to do
        fail("worker", f"job {spec.job!r} failed: {why}", _exit_code(outcome, signals.received))


def _exit_code(outcome: JobOutcome, signum: int | None) -> int:
    """The worker's exit code for a failed outcome (see EXIT_CODES_HELP): a rank's own code is only in the message."""
    if signum is not None:
        return 128 + signum
    if outcome.lease_lost:
        return EXIT_UNREACHABLE
    kind = error_kind(outcome.error) if outcome.error is not None else ""
    if kind in ("UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        return EXIT_UNREACHABLE
    if kind == "DEADLINE_EXCEEDED":
        return EXIT_TIMEOUT
    return EXIT_FAILED


def _run_daemon(conn: ConnectOptions, config: DaemonConfig) -> None:
    signals = _Signals()
    try:
        daemon = start_daemon(conn, config)
    except CoordinatorError as e:
        fail_coordinator("worker", e, conn.address)
    while not signals.event.wait(0.5):
        pass
    daemon.stop()
