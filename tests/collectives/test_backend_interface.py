"""The generic backend interface: each backend's own options, checked through the registry, and the optional
prepared-op capability."""

from __future__ import annotations

import numpy as np
import pytest

from axond.distributed import BackendOptions, create_group
from axond.distributed.backends.registry import check_options, options_class
from axond.distributed.backends.tcp import TcpBackend, TcpOptions
from axond.store import InMemoryStore
from axond.testing import run_on, thread_groups


def test_each_backend_declares_its_own_options() -> None:
    assert options_class("tcp") is TcpOptions
    assert options_class("mock") is None and options_class("nccl") is None


@pytest.mark.parametrize("kwargs, message", [
    ({"port": 5}, "no backend is named 'port'.*TcpOptions fields"),
    ({"nccl": TcpOptions()}, "the nccl backend takes no options of its own"),
    ({"tcp": {"port": 5}}, "must be a axond.distributed.backends.tcp.options.TcpOptions, got dict"),
])
def test_the_registry_refuses_options_no_backend_takes(kwargs: dict[str, object], message: str) -> None:
    options = BackendOptions(timeout=1.0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        check_options(options)
    with pytest.raises(TypeError, match=message):
        create_group(InMemoryStore(), 0, 1, "mock", options)


def test_a_new_group_drops_the_default_groups_fixed_port() -> None:
    options = BackendOptions(timeout=3.0, tcp=TcpOptions(port=29999, small_bytes=1024))
    sub = options.for_new_group(7.0)
    assert sub.timeout == 7.0 and sub.options_of("tcp") == TcpOptions(port=0, small_bytes=1024)
    assert options.for_new_group().timeout == 3.0 and options.options_of("mock") is None


def test_tcp_takes_the_options_given_and_reads_the_rest_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_TCP_SMALL_BYTES", "4096")
    read = create_group(InMemoryStore(), 0, 1, "tcp", BackendOptions(timeout=5.0))
    given = create_group(InMemoryStore(), 0, 1, "tcp", BackendOptions(timeout=5.0, tcp=TcpOptions(small_bytes=8192)))
    try:
        assert isinstance(read.backend, TcpBackend) and isinstance(given.backend, TcpBackend)
        assert read.backend.tcp_options.small_bytes == 4096 and given.backend.tcp_options.small_bytes == 8192
    finally:
        read.destroy()
        given.destroy()


def test_prepared_ops_are_a_capability_the_group_asks_for() -> None:
    """tcp has it (its second small all_reduce of a shape runs prepared); mock has not, and runs every op in full."""
    tcp = thread_groups(2, options=BackendOptions(timeout=10.0))
    mock = thread_groups(2, backend="mock", options=BackendOptions(timeout=10.0))
    try:
        for groups in (tcp, mock):
            got = run_on(groups, lambda g: [g.all_reduce(x := np.full(4, g.rank + 1.0)) or x.copy() for _ in range(3)])
            assert all((a == 3.0).all() for rows in got for a in rows)
        assert all(len(g.fast_path) == 1 for g in tcp)  # the signature was prepared, and runs the short way
        assert not any(len(g.fast_path) for g in mock)
    finally:
        for g in tcp + mock:
            g.destroy()
