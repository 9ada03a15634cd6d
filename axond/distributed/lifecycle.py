"""The default group's life: `init_process_group` (from the environment, the arguments, or a live job's later
generation), `destroy_process_group`, `is_initialized`, `get_local_rank`; re-exported by `axond.distributed.api`."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from typing import Any

from axond.config import ConfigError, RuntimeEnv
from axond.distributed import default_registry as defaults
from axond.distributed import live_place, live_watch
from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.registry import options_class
from axond.distributed.diagnostics.failure import install as install_failure_hook
from axond.distributed.forms import torch_forms as tf
from axond.distributed.process_group import ProcessGroup, create_group
from axond.errors import DistributedError, StoreError
from axond.store import Store
from axond.store.init_methods import InitMethod, OpenedStore, open_store, parse, seconds

_lock = threading.Lock()
_owned: OpenedStore | None = None
"""The store opened for the default group (and what closes it), closed by destroy_process_group."""
_local_rank = 0
DEFAULT_TIMEOUT = 300.0
BACKEND_ALIASES = {"gloo": "tcp"}
"""torch backend names axond accepts for its own: gloo's role (CPU arrays over TCP) is the tcp backend's."""


def _env_int(name: str, given: int | str | None, found: int | None) -> int:
    """`given` (an argument) as an int, else `found` (variable `name` of the environment)."""
    if given is not None:
        text = str(given).strip()
        if len(text) > 40 or not text.lstrip("+-").isdigit():
            raise DistributedError(f"init_process_group: {name.lower()}={text[:40]!r} is not an integer")
        return int(text)
    if found is None:
        raise DistributedError(f"init_process_group: {name} is not set; launch with `axond worker`/`axond run` "
                               f"(or torchrun, mpirun, mpiexec, srun --mpi=pmix), or pass {name.lower()}=...")
    return found


def read_env(env: RuntimeEnv | None = None) -> RuntimeEnv:
    """`env`, else this process's environment read now; a bad variable raises `DistributedError` naming it."""
    if env is not None:
        return env
    try:
        return RuntimeEnv.from_env()
    except ConfigError as e:
        raise DistributedError(f"init_process_group: {e}") from e


def init_process_group(backend: str | None = "auto", *args: Any, timeout: float | timedelta | None = None,
                       init_method: str | None = None, rank: int | None = None, world_size: int | None = None,
                       store: Store | None = None, local_rank: int | None = None, job_secret: bytes | None = None,
                       host: str | None = None, port: int = 0, env: RuntimeEnv | None = None) -> ProcessGroup:
    """Join the job's default group: everything from the environment unless given here.

    Reads the environment once (`env`, default `axond.config.RuntimeEnv.from_env()`): RANK, WORLD_SIZE,
    LOCAL_RANK, AXOND_COORDINATOR, AXOND_JOB, AXOND_GENERATION, AXOND_JOB_SECRET (hex), AXOND_TOKEN and
    AXOND_TLS_CA, else MASTER_ADDR/MASTER_PORT, and passes it down to the store, the backend and failure
    reporting; keyword arguments override them. The second positional argument is the timeout (seconds or a timedelta,
    default 300 s), or, if it is a str, torch's `init_method` followed by torch's positional order
    (`init_process_group("gloo", "env://")`; see `axond.store.init_methods`). "gloo" means "tcp".
    Installs the hook that, on an uncaught exception, tells the peers why (see `axond.distributed.diagnostics.failure`).
    """
    given = {"timeout": timeout, "init_method": init_method, "world_size": world_size, "rank": rank, "store": store}
    if args and (isinstance(args[0], str) or args[0] is None):
        names = ("init_method", "timeout", "world_size", "rank", "store")
    elif len(args) <= 1:
        names = ("timeout", "init_method", "world_size", "rank", "store")
    else:
        raise TypeError(f"init_process_group: after backend, positional arguments are either (timeout,) or torch's "
                        f"(init_method, timeout, world_size, rank, store); got {len(args)} starting with {args[0]!r}")
    a = tf.bind("init_process_group", names, args, {k: v for k, v in given.items() if v is not None},
                dict.fromkeys(given))
    init_method, store = a["init_method"], a["store"]
    rank, world_size = (None if v == -1 else v for v in (a["rank"], a["world_size"]))  # torch's -1: from the env
    limit = seconds(a["timeout"] if a["timeout"] is not None else DEFAULT_TIMEOUT)
    if store is not None and init_method is not None:
        raise ValueError("init_process_group: pass init_method or store, not both")
    method = parse(init_method or "env://")
    name = BACKEND_ALIASES.get((backend or "auto").lower(), (backend or "auto").lower())
    env = read_env(env)
    given_place = store is not None or rank is not None or world_size is not None or "rank" in method.params
    while True:
        try:
            return _form(name, method, rank, world_size, store, limit, job_secret, local_rank, host, port, env)
        except (StoreError, DistributedError) as e:
            # a live job that moved on before this rank's group formed (another node left or joined meanwhile: its
            # store refuses the ended generation, or the peers never came): its place in the later generation the
            # worker names, as `axond.reform()` takes it; else the error as it is
            if given_place or live_place.moved_on(env, wait=isinstance(e, StoreError)) is None:
                raise
            env = read_env()


def _form(name: str, method: InitMethod, rank: int | None, world_size: int | None, store: Store | None,
          limit: float, job_secret: bytes | None, local_rank: int | None, host: str | None, port: int,
          env: RuntimeEnv) -> ProcessGroup:
    """`init_process_group` once, for the place `env` (or the arguments) name."""
    global _local_rank, _owned
    with _lock:
        if defaults.current() is not None:
            raise DistributedError("init_process_group was already called in this process; "
                                   "call destroy_process_group() first")
        r = _env_int("RANK", rank if rank is not None else method.params.get("rank"), env.rank)
        n = _env_int("WORLD_SIZE", world_size if world_size is not None else method.params.get("world_size"),
                     env.world_size)
        if not 1 <= n <= env.max_world_size:
            raise DistributedError(f"init_process_group: world_size={n} is outside 1..{env.max_world_size} "
                                   "(AXOND_MAX_WORLD_SIZE raises the limit)")
        if not 0 <= r < n:
            raise DistributedError(f"init_process_group: RANK={r} is outside WORLD_SIZE={n} (use 0..{n - 1})")
        secret = job_secret if job_secret is not None else env.job_secret
        options = BackendOptions(timeout=limit, job_secret=secret, host=host, device=local_rank, env=env,
                                 tcp=replace(options_class("tcp").from_env(env.environ), port=port) if port else None)
        owned = open_store(method, r, n, limit, secret, env) if store is None else None
        if owned is not None and owned.master_addr is not None:  # found through MPI: route to rank 0, its secret
            options = replace(options, env=env.with_vars(MASTER_ADDR=owned.master_addr),
                              job_secret=secret or owned.secret or b"")
        try:
            group = create_group(store if store is not None else owned.store, r, n, name, options)  # type: ignore[union-attr]
        except BaseException:
            _close_owned(owned)
            raise
        _owned = owned
        install_failure_hook()  # reporting as `env` says: the group's `track` configured it
        _local_rank = int(local_rank if local_rank is not None else env.local_rank or 0)
        live_watch.configure(env)
        defaults.install(group)
        return group


def is_initialized() -> bool:
    """Whether this process joined a default group."""
    return defaults.current() is not None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Close `group` (default: the default group, which becomes uninitialised)."""
    global _owned
    if group is not None and group is not defaults.current():
        group.destroy()
        return
    with _lock:
        pg = defaults.current()
        defaults.install(None)
        owned, _owned = _owned, None
    if pg is not None:
        pg.destroy()
    _close_owned(owned)


def _close_owned(owned: OpenedStore | None) -> None:
    for close in owned.closers if owned is not None else ():
        close()


def get_local_rank() -> int:
    """Rank of this process on its node (LOCAL_RANK)."""
    defaults.require()
    return _local_rank
