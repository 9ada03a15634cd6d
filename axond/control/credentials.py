"""Where the coordinator keeps its generated token, and how clients find a token.

A coordinator started without `--token` (and without `--insecure`) generates one and writes it to
`<state dir>/token`, readable only by its user. Clients take, in order: an explicit token, a token
file (`--token-file` / AXOND_TOKEN_FILE), AXOND_TOKEN, and finally, only when the coordinator's
address is on this machine (loopback), the token file of the default state directory. A client never
sends the local token to another machine's address.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from axond.config import RuntimeEnv
from axond.errors import CoordinatorError

TOKEN_FILE_NAME = "token"
MAX_TOKEN_CHARS = 4096


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in `path` (surrounding whitespace stripped); a clear error if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(MAX_TOKEN_CHARS + 1).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CoordinatorError(f"cannot read the token file {str(path)!r}: {e}") from e
    if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise CoordinatorError(
            f"the token file {str(path)!r} must hold one token of 1..{MAX_TOKEN_CHARS} characters without spaces"
        )
    return token


def ensure_token(state_dir: str | os.PathLike[str]) -> tuple[str, Path]:
    """The token kept in `state_dir`, generated (mode 0600, directory 0700) if there is none yet."""
    directory = Path(state_dir)
    path = directory / TOKEN_FILE_NAME
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path), path
    except OSError as e:
        raise CoordinatorError(
            f"cannot create the token file in {str(directory)!r}: {e.strerror}; pass --state-dir DIR (a directory "
            "this user can write), --token T, or --insecure"
        ) from e
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token, path


def _is_local(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LocalToken:
    """The token file of the default state directory `state_dir`, read when first found (for a client that may start
    before the coordinator on this machine has written it); None until then."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / TOKEN_FILE_NAME
        self._token: str | None = None

    def __call__(self) -> str | None:
        if self._token is None:
            path = self._path
            try:
                self._token = read_token_file(path) if path.is_file() else None
            except CoordinatorError:
                return None
        return self._token


def token_source(address: str, token: str | None = None, token_file: str | None = None,
                 env: RuntimeEnv | None = None) -> str | LocalToken | None:
    """What a client sends to `address`: a fixed token, a `LocalToken` for a coordinator on this machine
    (found now or once it has started), or None."""
    env = env if env is not None else RuntimeEnv.from_env()
    found = resolve_token(address, token, token_file, env)
    if found is None and _is_local(address):
        return LocalToken(env.state_dir)
    return found


def resolve_token(address: str, token: str | None = None, token_file: str | None = None,
                  env: RuntimeEnv | None = None) -> str | None:
    """The token a client sends to `address` (None: send none), from the sources in the module doc (the variables
    of `env`; default: this process's environment, read now)."""
    if token:
        return token
    env = env if env is not None else RuntimeEnv.from_env()
    token_file = token_file or env.token_file
    if token_file:
        return read_token_file(token_file)
    if env.token:
        return env.token
    if _is_local(address):
        path = env.state_dir / TOKEN_FILE_NAME
        if path.is_file():
            try:
                return read_token_file(path)
            except CoordinatorError:
                return None
    return None
