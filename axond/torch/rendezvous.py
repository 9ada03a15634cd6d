"""`init_method` schemes: `axond://HOST:PORT`, and `env://` inside ranks started by `axond worker`/`axond run`.

Both yield (a `TorchStore` over the coordinator's KV store of the job generation, rank, world size).
`env://` keeps torch's own behaviour whenever MASTER_ADDR is set; only when it is missing does it use the
coordinator (AXOND_COORDINATOR set: an axond-launched rank) or, in a rank an MPI launcher started with neither, rank
0's store found through MPI, instead of failing. In a live job (`axond worker --live-recovery`) `env://` always meets
in the coordinator's store of the rank's generation (`live_store`): the ranks that re-form torch's default group for a
new generation (`axond.torch.reform`) meet there, and a rank that joins the running job must meet them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

import sys

import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401 -- the module, shadowed by its function on torch.distributed

from axond.config import RuntimeEnv
from axond.control import client
from axond.distributed.api import read_env
from axond.errors import DistributedError
from axond.store import PrefixStore
from axond.store.mpi_rendezvous import mpi_store
from axond.torch.store import TorchStore

SCHEME = "axond"

_LIVE: list[TorchStore] = []
"""Stores handed to torch: torch keeps only their C++ half, so the Python object (its methods) is kept here."""
_INITS = itertools.count(1)
"""This process's rendezvous so far: the n-th of every rank meets under its own prefix, so that a re-init after
destroy_process_group never reads the addresses an earlier one published (every rank of a job inits as often)."""


def _setting(query: dict[str, list[str]], key: str, environ: Mapping[str, str], env: str,
             default: str | None = None) -> str:
    if key in query and query[key][-1] not in ("", "-1"):
        return query[key][-1]
    value = environ.get(env, default)
    if value is None:
        raise DistributedError(f"axond:// rendezvous: {env} is not set; launch with `axond worker`/`axond run`, "
                               f"pass {key}= to init_process_group, or add ?{key}=... to the URL")
    return value


def _int(name: str, raw: str) -> int:
    text = raw.strip()
    if len(text) > 40 or not text.lstrip("+-").isdigit():
        raise DistributedError(f"axond:// rendezvous: {name}={text[:40]!r} is not an integer")
    return int(text)


def coordinator_store(address: str, query: dict[str, list[str]], timeout: timedelta,
                      env: RuntimeEnv | None = None) -> tuple[dist.Store, int, int]:
    """(TorchStore over the KV of the job's generation at `address`, rank, world size) from the query or `env`
    (default: this process's environment, read now).

    The query may carry rank, world_size, job and generation; AXOND_TOKEN and AXOND_TLS_CA give the credentials.
    The keys of the n-th rendezvous of this process live under `init-n` (see `_INITS`).
    """
    env = read_env(env)
    rank = _int("rank", _setting(query, "rank", env.environ, "RANK"))
    world_size = _int("world_size", _setting(query, "world_size", env.environ, "WORLD_SIZE"))
    job = _setting(query, "job", env.environ, "AXOND_JOB", "default")
    generation = _int("generation", _setting(query, "generation", env.environ, "AXOND_GENERATION", "1"))
    if not 1 <= world_size <= env.max_world_size:
        raise DistributedError(f"axond:// rendezvous: world size {world_size} is outside 1..{env.max_world_size} "
                               "(AXOND_MAX_WORLD_SIZE raises the limit)")
    if not 0 <= rank < world_size:
        raise DistributedError(f"axond:// rendezvous: rank {rank} is outside world size {world_size}")
    conn = client.connect(address, env=env)
    store = TorchStore(PrefixStore(f"init-{next(_INITS)}", conn.store(job, generation)), timeout)
    store.connection = conn  # type: ignore[attr-defined]  # the channel lives as long as the store
    _LIVE.append(store)
    return store, rank, world_size


LIVE_PREFIX = "torch-live"
"""Where torch's default group of a live job's generation meets, in that generation's store (the same for the ranks
that started in it and the ones that re-formed into it)."""


def live_store(env: RuntimeEnv, timeout: timedelta) -> TorchStore:
    """A `TorchStore` over the coordinator's key-value store of `env`'s job and generation, under LIVE_PREFIX (a
    generation's own store: nothing of an older rendezvous is ever read, so no per-init prefix is needed)."""
    if not env.coordinator:
        raise DistributedError("torch's group of a live job meets in the coordinator's store: AXOND_COORDINATOR is not "
                               "set (run under `axond worker --live-recovery`)", op="rendezvous")
    conn = client.connect(env.coordinator, env=env)
    store = TorchStore(PrefixStore(LIVE_PREFIX, conn.store(env.job, env.generation)), timeout)
    store.connection = conn  # type: ignore[attr-defined]  # the channel lives as long as the store
    _LIVE.append(store)
    return store


def _live_handler(url: str, env: RuntimeEnv, timeout: timedelta) -> Iterator[tuple[Any, int, int]]:
    """`env://` in a live job: the generation's store (`live_store`), the rank and world size of the query or env."""
    query = parse_qs(urlparse(url).query)
    rank = _int("rank", _setting(query, "rank", env.environ, "RANK"))
    world_size = _int("world_size", _setting(query, "world_size", env.environ, "WORLD_SIZE"))
    if not 0 <= rank < world_size:
        raise DistributedError(f"env:// rendezvous of a live job: rank {rank} is outside world size {world_size}")
    yield live_store(env, timeout), rank, world_size
    raise DistributedError("env:// rendezvous of a live job cannot be restarted within one process; re-form with "
                           "axond.torch.live (or start the rank again)")


def _axond_handler(url: str, timeout: timedelta = timedelta(seconds=300), env: RuntimeEnv | None = None,
                   **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    parsed = urlparse(url)
    if not parsed.netloc:
        raise DistributedError(f"init_method {url!r}: write axond://HOST:PORT (the coordinator's address)")
    yield coordinator_store(parsed.netloc, parse_qs(parsed.query), timeout, env)
    raise DistributedError("axond:// rendezvous cannot be restarted within one process; start the rank again")


def _mpi_handler(env: RuntimeEnv, timeout: timedelta) -> Iterator[tuple[Any, int, int]]:
    """`env://` in a rank an MPI launcher started with no other rendezvous: rank 0's store found through MPI."""
    if env.rank is None or env.world_size is None:
        raise DistributedError(f"env:// rendezvous under {env.launcher}: the launcher gave no rank or world size")
    store, _, _ = mpi_store(env.rank, env.world_size, timeout.total_seconds(), env)
    torch_store = TorchStore(store, timeout)
    _LIVE.append(torch_store)
    yield torch_store, env.rank, env.world_size
    raise DistributedError("env:// rendezvous through MPI cannot be restarted within one process; start the job again")


def _env_handler(torch_env: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def handler(url: str, timeout: timedelta = timedelta(seconds=300), **kwargs: Any) -> Iterator[Any]:
        env = read_env()
        coordinator = env.coordinator
        if env.live_recovery and coordinator:
            return _live_handler(url, env, timeout)
        if "MASTER_ADDR" not in env.environ and not coordinator and env.launcher is not None:
            return _mpi_handler(env, timeout)
        if "MASTER_ADDR" in env.environ or not coordinator:
            return torch_env(url, timeout=timeout, **kwargs)
        return _axond_handler(f"{SCHEME}://{coordinator}?{urlparse(url).query}", timeout=timeout, env=env)
    handler.axond = True  # type: ignore[attr-defined]
    return handler


def install() -> None:
    """Register `axond://` and let `env://` fall back to the coordinator in axond-launched ranks; idempotent."""
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    if SCHEME not in handlers:
        dist.register_rendezvous_handler(SCHEME, _axond_handler)
    env = handlers.get("env")
    if env is not None and not getattr(env, "axond", False):
        handlers["env"] = _env_handler(env)
