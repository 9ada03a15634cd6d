"""`axond run`: submit a job to the worker daemons and stream its output until it finishes."""

from __future__ import annotations

import os
import queue
import re
import signal
import sys
import threading
import time
from types import FrameType

import click

from axond.cli.common import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, connect_wait_option
from axond.cli.common import coordinator_options, examples, explain, fail, fail_coordinator, is_connection_error
from axond.cli.common import need_address
from axond.cli.common import runtime_env, waiting_notice
from axond.control.client import CoordinatorClient, connect
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.worker.launcher import prefixed
from axond.worker.spec import parse_nnodes

CANCEL_WAIT_S = 20.0
"""After Ctrl-C, how long to wait for the cancelled job's final event before giving up."""

_END = object()


def _parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--env")
        env[key] = value
    return env


def _parse_nodes(text: str, live_recovery: bool) -> tuple[int, int]:
    try:
        lo, hi = parse_nnodes(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--nnodes") from e
    if lo != hi and not live_recovery:
        raise click.BadParameter(
            f"{text!r}: a submitted job takes a range of nodes with --live-recovery only (it then goes on while "
            f"{lo} are left); without it, give one number", param_hint="--nnodes")
    return lo, hi


class _EventPump:
    """Reads the job's event stream in a thread so the main thread stays interruptible. `close` closes the client
    and waits (bounded) for the thread: at exit the interpreter stops daemon threads wherever they are, and one
    stopped inside the stream's call can hang the exit (see `axond.control.kv_stream._OPEN`)."""

    def __init__(self, client: CoordinatorClient, job: str) -> None:
        self.events: queue.Queue[object] = queue.Queue(maxsize=10_000)
        self._client, self._job = client, job
        self._thread = threading.Thread(target=self._main, name="axond-run-stream", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            for event in self._client.stream_job(self._job):
                self.events.put(event)
        except (CoordinatorError, ValueError) as e:
            self.events.put(e)
        self.events.put(_END)

    def close(self, wait: float = 2.0) -> None:
        """Close the client (which ends the stream's call) and wait up to `wait` seconds for the thread to end."""
        self._client.close()
        self._thread.join(wait)


def _print_event(event: pb.JobEvent) -> pb.JobFinished | None:
    kind = event.WhichOneof("event")
    if kind == "output":
        line = event.output
        out = sys.stderr if line.stream == "stderr" else sys.stdout
        out.write((prefixed(line.rank, line.text) if line.rank >= 0 else line.text) + "\n")
        out.flush()
    elif kind == "info":
        click.echo(f"axond run: {event.info}", err=True)
    elif kind == "finished":
        return event.finished
    return None


@click.command(
    "run",
    short_help="Submit a job to the worker daemons and stream its output.",
    context_settings={"allow_interspersed_args": False},
    epilog=examples("axond run --coordinator HOST:29500 --nnodes 2 --nproc-per-node 4 -- python train.py",
                    "axond run --coordinator HOST:29500 --attach my-job")
    + "Ctrl-C cancels the job (exit code 130). " + EXIT_CODES_HELP,
)
@coordinator_options
@connect_wait_option
@click.option("--nnodes", default=None, metavar="N|MIN:MAX",
              help="Worker daemons to run the job on [required]; MIN:MAX (with --live-recovery): placed on MAX, "
              "goes on while at least MIN are left.")
@click.option("--nproc-per-node", "--nproc_per_node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rank processes on each node.")
@click.option("--job", default="", help="Job name [default: chosen by the coordinator].")
@click.option("--max-restarts", "--max_restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job this many times after a failure.")
@click.option("--live-recovery", is_flag=True, default=False,
              help="When a node's rank fails and at least MIN of --nnodes are left, go on without it: the other "
              "ranks keep their processes and re-form (docs/live-recovery.md).")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra environment for the ranks.")
@click.option("--cwd", default=None, metavar="DIR",
              help="Working directory of the ranks [default: this one, if it exists on the worker].")
@click.option("--attach", default=None, metavar="JOB",
              help="Instead of submitting, re-attach to submitted job JOB: print its output from the start and exit "
              "with its status (Ctrl-C detaches without cancelling it).")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD ARGS...")
def run(
    address: str | None, token: str | None, tls_ca: str | None, connect_wait: float, nnodes: str | None,
    nproc_per_node: int, job: str, max_restarts: int, live_recovery: bool, env_pairs: tuple[str, ...], cwd: str | None,
    attach: str | None, cmd: tuple[str, ...],
) -> None:
    """Submit CMD to the worker daemons, stream its rank-prefixed output, exit with its status."""
    address = need_address(address)
    if attach is not None and (cmd or nnodes is not None):
        raise click.UsageError("--attach JOB follows a job already submitted: drop --nnodes and the command")
    if attach is None and (not cmd or nnodes is None):
        raise click.UsageError("submit with --nnodes N [--nproc-per-node K] -- CMD ARGS..., or follow a job with --attach JOB")
    env = _parse_env(env_pairs)
    min_nodes, max_nodes = _parse_nodes(nnodes, live_recovery) if nnodes is not None else (0, 0)
    try:
        client = connect(address, token=token, tls_ca=tls_ca, connect_wait=connect_wait, on_wait=waiting_notice("run"),
                         env=runtime_env())
    except CoordinatorError as e:
        fail_coordinator("run", e, address)
    if attach is not None:
        try:
            code = _follow(client, attach, address, cancel=False)
        finally:
            client.close()
        sys.exit(code)
    try:
        try:
            name = client.submit_job(
                list(cmd), max_nodes, nproc_per_node, job=job, env=env, max_restarts=max_restarts,
                cwd=cwd if cwd is not None else os.getcwd(), min_nodes=min_nodes, live_recovery=live_recovery,
            )
        except CoordinatorError as e:
            fail_coordinator("run", e, address)
        click.echo(f"axond run: submitted job {name!r}", err=True)
        code = _follow(client, name, address)
    finally:
        client.close()
    sys.exit(code)


def _follow(client: CoordinatorClient, job: str, address: str, cancel: bool = True) -> int:
    """Print the job's events until it finishes; returns the exit code (0, 1 if it failed, 128+N if this
    command cancelled it on signal N). With `cancel` False a signal only stops following (128+N)."""
    interrupted: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    pump = _EventPump(client, job)
    try:
        return _print_events(pump, client, job, address, interrupted, cancel)
    finally:
        pump.close()


def _print_events(pump: _EventPump, client: CoordinatorClient, job: str, address: str, interrupted: list[int],
                  cancel: bool) -> int:
    """`_follow`'s loop: the pump's events printed until the job finished, or a signal stopped following it."""
    cancel_deadline: float | None = None
    while True:
        if interrupted and not cancel:
            click.echo(f"axond run: detached from job {job!r}; it keeps running (axond run --attach {job})", err=True)
            return 128 + interrupted[0]
        if interrupted and cancel_deadline is None:
            click.echo(f"axond run: cancelling job {job!r}", err=True)
            cancel_deadline = time.monotonic() + CANCEL_WAIT_S
            try:
                client.cancel_job(job)
            except CoordinatorError as e:
                fail("run", f"could not cancel job {job!r}: {explain(e, address)}", EXIT_FAILED)
        if cancel_deadline is not None and time.monotonic() > cancel_deadline:
            fail("run", f"job {job!r} was cancelled but did not finish within {CANCEL_WAIT_S:.0f} s",
                 128 + interrupted[0])
        try:
            item = pump.events.get(timeout=0.2)
        except queue.Empty:
            continue
        if item is _END:
            fail("run", f"the event stream of job {job!r} ended before the job finished", EXIT_FAILED)
        if isinstance(item, (CoordinatorError, ValueError)):
            code = EXIT_UNREACHABLE if is_connection_error(item) else EXIT_FAILED
            fail("run", f"lost the event stream of job {job!r}: {explain(item, address)}", code)
        assert isinstance(item, pb.JobEvent)
        finished = _print_event(item)
        if finished is not None:
            if finished.exit_code == 0:
                return EXIT_OK
            if interrupted:
                return 128 + interrupted[0]
            why = _once(finished.message) or f"exit code {finished.exit_code}"
            click.echo(f"axond run: job {job!r} failed: {why}", err=True)
            return EXIT_FAILED


_RESTATED = re.compile(r"rank (\d+) on node \S+ \(.*?\) failed with exit code -?\d+: (?=rank \1 \()")
"""The coordinator's "rank R on node N (host) failed with exit code C: " before the worker's own description of
the same rank ("rank R (host, pid P) exited with code C: ..."), which says it all already."""


def _once(reason: str) -> str:
    """The job's reason without the coordinator's restatement of the worker's failure line."""
    return _RESTATED.sub("", reason, count=1)

