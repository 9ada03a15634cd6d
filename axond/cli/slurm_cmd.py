"""`axond slurm`: run a job across a Slurm allocation, one task per node, the coordinator on the first node."""

from __future__ import annotations

import time
from pathlib import Path

import click

from axond.cli.common import EXIT_CODES_HELP, EXIT_FAILED, EXIT_UNREACHABLE, connect_wait_option, fail
from axond.cli.common import _check_address, runtime_env, waiting_notice
from axond.cli.worker_cmd import _run_agent
from axond.control.credentials import read_token_file
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.slurm import Allocation, SlurmError, default_token_path, head_address, publish_token
from axond.worker.slurm import wait_for_token
from axond.worker.spec import ConnectOptions, JobSpec

_PROG = "slurm"


@click.command(
    "slurm",
    short_help="Run a job across a Slurm allocation (under srun, one task per node).",
    context_settings={"allow_interspersed_args": False},
    epilog=(
        "Run it once per node: `srun --ntasks-per-node=1 axond slurm [OPTIONS] -- CMD ARGS...`. The step's first "
        "node starts the coordinator (on --port, by default 29500 + SLURM_JOB_ID % 1000) and every node joins "
        "job NAME with --nnodes = the step's node count. The token comes from --token / AXOND_TOKEN, else from "
        "--token-file, else the first node writes a fresh one to ~/.axond/slurm/JOB.STEP.token (mode 0600) and "
        "the others read it there (a home directory every node shares). " + EXIT_CODES_HELP
    ),
)
@click.option("--nproc-per-node", default="auto", show_default=True, metavar="N|auto|gpu|cpu",
              help="Ranks per node: a number, gpu (SLURM_GPUS_ON_NODE), cpu (the task's CPUs) or auto (the GPUs "
                   "if Slurm gave the node any, else 1).")
@click.option("--job", default=None, help="Job name [default: SLURM_JOB_NAME-SLURM_JOB_ID].")
@click.option("--coordinator", "address", default=None, metavar="HOST:PORT", callback=_check_address,
              help="Join this running coordinator instead of starting one on the first node (pass its --token or "
                   "--token-file too).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port of the coordinator on the first node [default: 29500 + SLURM_JOB_ID % 1000].")
@click.option("--token", envvar="AXOND_TOKEN", default=None,
              help="Token of the job's coordinator, the same on every node [env AXOND_TOKEN].")
@click.option("--token-file", envvar="AXOND_TOKEN_FILE", type=click.Path(dir_okay=False), default=None,
              help="Token file on storage every node shares: read if it exists, else written by the first node "
                   "[env AXOND_TOKEN_FILE; default ~/.axond/slurm/JOB.STEP.token, removed at the end].")
@connect_wait_option
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failure anywhere.")
@click.option("--join-timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for every node of the step to join.")
@click.option("--stop-grace", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping ranks.")
@click.option("--linger", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="First node: seconds to keep the coordinator up after its own ranks ended, until the other "
                   "nodes have left the job.")
@click.option("--dry-run", is_flag=True, help="Print what this node would do and exit (nothing is started).")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD ARGS...")
def slurm(
    nproc_per_node: str, job: str | None, address: str | None, port: int | None, token: str | None,
    token_file: str | None, connect_wait: float, max_restarts: int, join_timeout: float, stop_grace: float,
    linger: float, dry_run: bool, cmd: tuple[str, ...],
) -> None:
    """Run CMD as one job over the nodes of this Slurm step (the first node runs the coordinator)."""
    env = runtime_env()
    try:
        alloc = Allocation.from_env(env.environ)
        nproc = alloc.nproc(nproc_per_node)
        spec = JobSpec(argv=cmd, job=job or alloc.default_job(), nproc_per_node=nproc, min_nodes=alloc.nnodes,
                       max_nodes=alloc.nnodes, max_restarts=max_restarts, join_timeout=join_timeout,
                       stop_grace=stop_grace)
    except ValueError as e:  # SlurmError included
        raise click.UsageError(str(e)) from e
    if address is not None:
        _join_existing(alloc, spec, address, token, token_file, connect_wait, dry_run)
        return
    port = port or alloc.default_port()
    try:
        host = head_address(alloc)
    except SlurmError as e:
        fail(_PROG, str(e), EXIT_UNREACHABLE)
    address = f"{host}:{port}"
    path = Path(token_file) if token_file else default_token_path(alloc)
    _announce(alloc, spec, address, "started here" if alloc.is_head else f"on {alloc.head}")
    if dry_run:
        _print_plan(alloc, spec, address, "--token/AXOND_TOKEN" if token else str(path))
        return
    published = False
    if not token:
        if path.is_file() or not alloc.is_head:
            try:
                token = wait_for_token(path, connect_wait)
            except SlurmError as e:
                fail(_PROG, str(e), EXIT_UNREACHABLE)
        else:
            try:
                token = publish_token(path)
            except OSError as e:
                fail(_PROG, f"cannot write the token file {path}: {e.strerror}; pass --token-file PATH on shared "
                            "storage, or set AXOND_TOKEN in the batch script", EXIT_FAILED)
            published = token_file is None
    conn = ConnectOptions(address, token=token, connect_wait=connect_wait, on_wait=waiting_notice(_PROG))
    if not alloc.is_head:
        _run_agent(conn, spec)
        return
    _run_head(conn, spec, host, port, linger, path if published else None)


def _announce(alloc: Allocation, spec: JobSpec, address: str, where: str) -> None:
    here = alloc.nodes[alloc.node_id]
    click.echo(f"axond slurm: Slurm job {alloc.job_id}: node {alloc.node_id} of {alloc.nnodes} ({here}), "
               f"coordinator at {address} ({where}), job {spec.job!r}, {spec.nproc_per_node} ranks per node",
               err=True)
    notice = alloc.rank_order_notice()
    if notice:
        click.echo(f"axond slurm: {notice}", err=True)


def _print_plan(alloc: Allocation, spec: JobSpec, address: str, token_source: str) -> None:
    click.echo(f"job={spec.job} nnodes={alloc.nnodes} node_id={alloc.node_id} head={alloc.head} "
               f"coordinator={address} nproc_per_node={spec.nproc_per_node} token={token_source}")


def _join_existing(
    alloc: Allocation, spec: JobSpec, address: str, token: str | None, token_file: str | None, connect_wait: float,
    dry_run: bool,
) -> None:
    """Every node joins the coordinator at `address` with the token given for it."""
    if not token and not token_file:
        raise click.UsageError("--coordinator: pass that coordinator's token (--token, AXOND_TOKEN or --token-file)")
    _announce(alloc, spec, address, "given")
    if dry_run:
        _print_plan(alloc, spec, address, "--token/AXOND_TOKEN" if token else str(token_file))
        return
    if not token:
        try:
            token = read_token_file(str(token_file))
        except CoordinatorError as e:
            raise click.UsageError(str(e)) from e
    _run_agent(ConnectOptions(address, token=token, connect_wait=connect_wait, on_wait=waiting_notice(_PROG)), spec)


def _run_head(
    conn: ConnectOptions, spec: JobSpec, host: str, port: int, linger: float, token_path: Path | None
) -> None:
    """Serve the coordinator in this process while this node's ranks run, then until the other nodes left."""
    from axond.coordinator.server import CoordinatorConfig, start_coordinator

    try:
        try:
            coordinator = start_coordinator(CoordinatorConfig(host=host, port=port, token=conn.token, in_memory=True))
        except CoordinatorError as e:
            fail(_PROG, f"cannot start the coordinator on {host}:{port}: {e}; pass another --port", EXIT_FAILED)
        try:
            _run_agent(conn, spec)
        finally:
            _wait_for_others(conn, linger)
            coordinator.stop(grace=1.0)
    finally:
        if token_path is not None:
            token_path.unlink(missing_ok=True)


def _wait_for_others(conn: ConnectOptions, linger: float) -> None:
    """Until no live node is registered any more (each worker deregisters when it is done), at most `linger` s."""
    deadline = time.monotonic() + linger
    try:
        client = ConnectOptions(conn.address, token=conn.token, call_timeout=5.0).connect()
    except CoordinatorError:
        return
    try:
        while time.monotonic() < deadline:
            nodes = client.get_status().nodes
            if not any(n.health != pb.NODE_HEALTH_DEAD for n in nodes):
                return
            time.sleep(0.2)
    except CoordinatorError:
        return
    finally:
        client.close()
