"""What every client command shares: connection flags, exit codes and error reporting."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from axond.config import ConfigError, RuntimeEnv
from axond.control.channel import normalize_address
from axond.control.client import DEFAULT_CONNECT_WAIT_S
from axond.control.credentials import read_token_file
from axond.control.errors import NotGrpcError
from axond.errors import CoordinatorError

EXIT_OK = 0
"""Success (for `worker` and `run`: every rank exited 0)."""
EXIT_FAILED = 1
"""The job failed (a rank exited non-zero or was killed, on any node; its own code is in the message),
the coordinator is not serving (`health`), or could not start (`coordinator`)."""
EXIT_USAGE = 2
"""Bad flags or arguments (click's usage errors)."""
EXIT_UNREACHABLE = 3
"""The coordinator could not be reached, or refused the token / TLS set-up."""
EXIT_TIMEOUT = 4
"""The rendezvous did not complete within --join-timeout (workers missing)."""

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 the job failed (a rank exited non-zero; the message names it and its code), or the "
    "coordinator is not serving / could not start; 2 usage error; 3 cannot reach or authenticate to the "
    "coordinator (at start, or for a whole lease while running: the ranks were stopped); 4 the rendezvous timed out; 128+N stopped by signal N (130: Ctrl-C)."
)
"""The table of docs/cli.md in one line, for each command's --help."""

F = TypeVar("F", bound=Callable[..., Any])


def examples(*lines: str) -> str:
    """An "Examples:" block for a command's --help epilog, kept as written (click's `\\b`), then a blank line."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines) + "\n\n"


def _client_credentials(func: F) -> F:
    """Fold `--token-file` into `token` and export a client certificate for connect() and the ranks."""

    @functools.wraps(func)
    def wrapper(*args: Any, token_file: str | None, tls_cert: str | None, tls_key: str | None, **kwargs: Any) -> Any:
        if (tls_cert is None) != (tls_key is None):
            raise click.UsageError("--tls-cert and --tls-key go together (the client certificate of mutual TLS)")
        if tls_cert and tls_key:
            os.environ["AXOND_TLS_CERT"], os.environ["AXOND_TLS_KEY"] = tls_cert, tls_key
        if token_file and not kwargs.get("token"):
            try:
                kwargs["token"] = read_token_file(token_file)
            except CoordinatorError as e:
                raise click.UsageError(str(e)) from e
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def runtime_env(**variables: str) -> RuntimeEnv:
    """This command's environment, read once (with `variables` added, e.g. what a worker gives its ranks); a bad
    variable is a usage error naming it."""
    try:
        env = RuntimeEnv.from_env(os.environ)
        return env.with_vars(**variables) if variables else env
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


LOCAL_COORDINATOR = "127.0.0.1:29500"
"""Where `axond status` and `axond health` look without --coordinator or AXOND_COORDINATOR: `axond coordinator`'s
default port on this machine."""


def coordinator_options(func: F) -> F:
    """Add `--coordinator` (required), `--token`, `--token-file`, `--tls-ca` and the mutual-TLS client certificate
    (`--tls-cert`, `--tls-key`), each also from its AXOND_* variable."""
    return _coordinator_options(func, (), "required")


def coordinator_options_local(func: F) -> F:
    """`coordinator_options` for commands that only ask: `--coordinator` defaults to LOCAL_COORDINATOR."""
    return _coordinator_options(func, (), f"default {LOCAL_COORDINATOR}")


def coordinator_options_torchrun(func: F) -> F:
    """`coordinator_options` for the worker, with torchrun's `--rdzv-endpoint` / `--rdzv_endpoint` as names of
    `--coordinator` (not needed with --standalone)."""
    return _coordinator_options(func, ("--rdzv-endpoint", "--rdzv_endpoint"), "required unless --standalone")


def _coordinator_options(func: F, aliases: tuple[str, ...], need: str) -> F:
    func = _client_credentials(func)
    func = click.option(
        "--tls-key", envvar="AXOND_TLS_KEY", type=click.Path(exists=True, dir_okay=False), default=None,
        help="PEM private key of --tls-cert [env AXOND_TLS_KEY].",
    )(func)
    func = click.option(
        "--tls-cert", envvar="AXOND_TLS_CERT", type=click.Path(exists=True, dir_okay=False), default=None,
        help="PEM client certificate, for a coordinator that requires mutual TLS [env AXOND_TLS_CERT].",
    )(func)
    func = click.option(
        "--token-file", envvar="AXOND_TOKEN_FILE", type=click.Path(dir_okay=False), default=None,
        help="File holding the coordinator's token, e.g. DIR/token of its --state-dir [env AXOND_TOKEN_FILE]. "
        "Without --token or --token-file, a coordinator on this machine is found through its default state dir.",
    )(func)
    func = click.option(
        "--tls-ca", envvar="AXOND_TLS_CA", type=click.Path(exists=True, dir_okay=False), default=None,
        help="PEM file of the CA that signed the coordinator's TLS certificate [env AXOND_TLS_CA].",
    )(func)
    func = click.option(
        "--token", envvar="AXOND_TOKEN", default=None,
        help="Shared token the coordinator was started with [env AXOND_TOKEN].",
    )(func)
    func = click.option(
        "--coordinator", *aliases, "address", envvar="AXOND_COORDINATOR", default=None, metavar="HOST:PORT",
        callback=_check_address, help=f"Address of the coordinator [env AXOND_COORDINATOR; {need}].",
    )(func)
    return func


def _check_address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a malformed --coordinator as a usage error (gRPC would only say "Misformatted domain name")."""
    if value is None:
        return None
    try:
        return normalize_address(value)
    except CoordinatorError as e:
        raise click.BadParameter(str(e)) from e


def need_address(address: str | None, alternative: str = "") -> str:
    """The --coordinator value, or a usage error saying how to give it (and `alternative`, if given)."""
    if not address:
        raise click.UsageError("Missing option '--coordinator' HOST:PORT (or set AXOND_COORDINATOR)" + alternative)
    return address


def connect_wait_option(func: F) -> F:
    """Add `--connect-timeout` (also AXOND_CONNECT_TIMEOUT): how long to wait for a coordinator that is starting."""
    return click.option(
        "--connect-timeout", "connect_wait", envvar="AXOND_CONNECT_TIMEOUT", type=click.FloatRange(min=0),
        default=DEFAULT_CONNECT_WAIT_S, show_default=True,
        help="Seconds to keep trying a coordinator that is not listening yet (0: fail at once) "
             "[env AXOND_CONNECT_TIMEOUT].",
    )(func)


def waiting_notice(prog: str) -> Callable[[str], None]:
    """Print the client's "waiting for the coordinator" line as `axond PROG: ...` on stderr."""
    return lambda text: click.echo(f"axond {prog}: {text}", err=True)


def error_kind(e: BaseException) -> str:
    """The gRPC status name behind a CoordinatorError ("" if none is known)."""
    for candidate in (e, e.__cause__, e.__context__):
        code = getattr(candidate, "code", None)
        if callable(code):
            try:
                code = code()
            except Exception:  # noqa: BLE001 - a foreign object's code() is only a hint
                code = None
        name = getattr(code, "name", None)
        if isinstance(name, str):
            return name
    text = str(e)
    for name in ("UNAUTHENTICATED", "PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
        if name in text:
            return name
    return ""


def is_connection_error(e: BaseException) -> bool:
    """Whether `e` means "cannot reach or authenticate to the coordinator" (exit code 3)."""
    return error_kind(e) in ("UNAUTHENTICATED", "PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED")


def server_detail(e: BaseException) -> str:
    """The gRPC status detail the server sent with the failure behind `e` ("" if none)."""
    details = getattr(e.__cause__, "details", None)
    if callable(details):
        try:
            return str(details() or "")
        except Exception:  # noqa: BLE001 - only a nicer message is at stake
            return ""
    return ""


def _detail(e: BaseException) -> str:
    """The server's short detail behind `e` (the gRPC status detail when there is one)."""
    text = server_detail(e)
    return f"{error_kind(e)}: {text}" if text else str(e)


def explain(e: BaseException, address: str) -> str:
    """A one-line explanation of a coordinator error, saying what to do."""
    kind = error_kind(e)
    if isinstance(e, NotGrpcError):
        return f"cannot reach the coordinator: {e}"
    if kind == "UNAUTHENTICATED":
        return (
            f"the coordinator at {address} refused the token: pass the token it was started with (--token, "
            f"AXOND_TOKEN, or --token-file with the `token` file of its --state-dir) [{_detail(e)}]"
        )
    if kind == "PERMISSION_DENIED":
        return f"the coordinator at {address} refused the request [{_detail(e)}]"
    if kind in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return (
            f"cannot reach the coordinator at {address}: is `axond coordinator` running at {address}? "
            f"(pass --tls-ca if it serves TLS) [{_detail(e)}]"
        )
    return str(e)


def fail(prog: str, message: str, code: int) -> NoReturn:
    """Print `prog: message` on stderr and exit with `code` (no traceback)."""
    click.echo(f"axond {prog}: {message}", err=True)
    sys.exit(code)


def fail_coordinator(prog: str, e: CoordinatorError, address: str) -> NoReturn:
    """Exit after a coordinator error: 3 if unreachable/refused, else 1."""
    fail(prog, explain(e, address), EXIT_UNREACHABLE if is_connection_error(e) else EXIT_FAILED)
