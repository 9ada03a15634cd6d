"""What this process is blocked in, published where its worker and `axond status` look, whatever its groups' store.

`inflight` publishes each group's slow ops to the store the group was built on, for its peers. A native rank that
`axond worker` launched builds its groups on the job generation's coordinator store, where the worker and
`axond status --job` read them. A torch rank builds them on torch's store (the worker's MASTER_ADDR store), which
they do not read. So a process that a worker launched (AXOND_COORDINATOR, AXOND_JOB, AXOND_GENERATION and RANK set)
and whose groups do not already publish to that coordinator store under its RANK publishes the union of its slow
ops there itself, through a connection opened the first time an op is slow (never for a process whose ops are
fast). A store that cannot be opened or written only loses the report, and is tried again after
`RETRY_OPEN_S`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from axond.config import ConfigError, RuntimeEnv
from axond.store import Store
from axond.store.init_methods import coordinator_store

RETRY_OPEN_S = 10.0
"""Seconds before trying again to open the coordinator store after a failed try."""

Slow = tuple[tuple[str, str, float, int], ...]
"""(group, op, since as time.monotonic(), sequence number in its group) of each slow op, sorted."""


class JobSink:
    """Publishes a process's slow ops under `key` in the job's coordinator store; `publish` never raises."""

    def __init__(self, key: str, opener: Callable[[], tuple[Store, Callable[[], None]]] | None = None) -> None:
        """`opener` opens the store and returns it with what closes it (default: from this process's environment;
        none there: the sink stays off)."""
        self._key = key
        self._opener = opener
        self._store: Store | None = None
        self._close: Callable[[], None] | None = None
        self._failed_at = -RETRY_OPEN_S
        self._published: Slow = ()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether this process has somewhere to publish (a worker launched it)."""
        return self._opener is not None

    def publish(self, slow: Slow) -> None:
        """Publish `slow` if it differs from what was published last (bounded by the store's own timeouts)."""
        with self._lock:
            if self._opener is None or slow == self._published:
                return
            store = self._open()
            if store is None:
                return
            now, wall = time.monotonic(), time.time()
            report = {"pid": os.getpid(), "host": socket.gethostname(), "at": wall,
                      "ops": [{"group": g, "op": op, "since": wall - (now - since), "seq": seq}
                              for g, op, since, seq in slow]}
            with contextlib.suppress(Exception):  # a closed or failing store only loses the report
                store.set(self._key, json.dumps(report).encode())
                self._published = slow

    def put(self, key: str, value: bytes) -> None:
        """Set `key` to `value` in the job's coordinator store (a failing store only loses it)."""
        with self._lock:
            if self._opener is None:
                return
            store = self._open()
            if store is not None:
                with contextlib.suppress(Exception):  # a closed or failing store only loses the value
                    store.set(key, value)

    def _open(self) -> Store | None:
        if self._store is not None:
            return self._store
        if time.monotonic() - self._failed_at < RETRY_OPEN_S or self._opener is None:
            return None
        try:
            self._store, self._close = self._opener()
        except Exception:  # noqa: BLE001 - no coordinator: no report, the job goes on
            self._failed_at = time.monotonic()
        return self._store

    def close(self) -> None:
        with self._lock:
            if self._close is not None:
                with contextlib.suppress(Exception):  # closing a connection that failed already
                    self._close()
            self._store = self._close = None


def launched_env() -> RuntimeEnv | None:
    """This process's environment when a worker launched it with a coordinator store to publish to, else None."""
    try:
        env = RuntimeEnv.from_env(strict=False)
    except ConfigError:
        return None
    if not env.coordinator or env.rank is None or not env.job or "AXOND_GENERATION" not in env.environ:
        return None
    return env


def coordinator_opener(env: RuntimeEnv) -> Callable[[], tuple[Store, Callable[[], None]]]:
    """Opens the job generation's coordinator store as `env` names it."""

    def open_store() -> tuple[Store, Callable[[], None]]:
        opened = coordinator_store(env.coordinator, env)

        def close() -> None:
            for closer in opened.closers:
                closer()

        return opened.store, close

    return open_store


def publishes_itself(stores: Sequence[tuple[Store, int]], env: RuntimeEnv) -> bool:
    """Whether one of (store, global rank) of this process's groups is the job's coordinator store (a store scoped
    to the job and generation `env` names, `axond.store.coordinator.CoordinatorStore`) under its RANK."""
    return any(getattr(s, "job", None) == env.job and getattr(s, "generation", None) == env.generation
               and rank == env.rank for s, rank in stores)
