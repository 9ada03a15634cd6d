"""Shared fixtures: a real coordinator on a loopback port and a client for it; groups of threads on loopback."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Coordinators started by tests keep their generated token in a private state directory (never the
# user's); subprocesses inherit it, so same-machine clients find the token as on a real install.
_STATE_DIR = tempfile.mkdtemp(prefix="axond-test-state-")
os.environ["AXOND_STATE_DIR"] = _STATE_DIR
for _name in ("AXOND_TOKEN", "AXOND_TOKEN_FILE"):
    os.environ.pop(_name, None)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_STATE_DIR, ignore_errors=True)


WORKERS = 2
"""Test processes a whole run (`pytest`, `pytest -m "not slow"`: no paths named) takes (pytest-xdist, a module's
tests in one process): most end-to-end tests wait on leases and timeouts rather than compute. A run of named files
or folders stays in one process (no start-up cost); `-n N` chooses, `-n 0` is one process."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A whole run in WORKERS processes unless `-n` was given (or pytest-xdist is missing, or this is its worker)."""
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and "PYTEST_XDIST_WORKER" not in os.environ and not config.getoption("usepdb", False)
            and not config.getoption("collectonly", False)):
        config.option.numprocesses = WORKERS
        config.option.dist = "loadfile"

from axond.control.client import CoordinatorClient, connect
from axond.coordinator.server import CoordinatorConfig, RunningCoordinator, start_coordinator
from axond.distributed import ProcessGroup
from axond.testing import node_hosts, thread_groups
from collective_cases import NODES, backend_of, group_members, transport_options


@pytest.fixture
def coordinator_factory() -> Iterator[Callable[..., RunningCoordinator]]:
    """Start coordinators with CoordinatorConfig overrides (host 127.0.0.1, port 0, in memory); all stopped after."""
    started: list[RunningCoordinator] = []

    def start(**overrides: Any) -> RunningCoordinator:
        config = CoordinatorConfig(**{"host": "127.0.0.1", "port": 0, "in_memory": True, **overrides})
        running = start_coordinator(config)
        started.append(running)
        return running

    try:
        yield start
    finally:
        for running in started:
            running.stop(grace=0.2)


@pytest.fixture
def coordinator(coordinator_factory: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    """An in-process coordinator with default settings on an OS-chosen loopback port."""
    return coordinator_factory()


@pytest.fixture
def client(coordinator: RunningCoordinator) -> Iterator[CoordinatorClient]:
    """A client of the `coordinator` fixture (5 s per-call timeout)."""
    c = connect(coordinator.address, call_timeout=5.0)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def make_groups() -> Iterator[Callable[..., list[ProcessGroup]]]:
    """`make_groups(n, timeout, crowded=None, transport="auto")`: the n members of a fresh group on threads,
    all destroyed after the test; `crowded` overrides whether the tcp backends think ranks outnumber cores
    (algorithm choice), `transport` is a key of TRANSPORTS ("mock": the mock backend)."""
    made: list[ProcessGroup] = []

    def make(n: int, timeout: float = 1.0, crowded: bool | None = None, transport: str = "auto") -> list[ProcessGroup]:
        hosts = node_hosts(n, NODES) if transport == "nodes" else None
        groups = thread_groups(n, options=transport_options(transport, timeout, crowded), hosts=hosts,
                               backend=backend_of(transport))
        made.extend(groups)
        return groups

    try:
        yield make
    finally:
        for g in made:
            g.destroy()


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def groups(request: pytest.FixtureRequest) -> Iterator[list[ProcessGroup]]:
    """The members of a tcp group of 1, 2, 3 and then 4 threads (20 s timeout), shared by one module's tests.

    A module can override it with (size, transport) parameters, e.g. EVERY_TRANSPORT (see test_collectives)."""
    yield from group_members(request.param, "auto")


@pytest.fixture
def made() -> Iterator[list[ProcessGroup]]:
    """Groups made by a test (appended to this list), destroyed after it."""
    out: list[ProcessGroup] = []
    yield out
    for g in out:
        g.destroy()
