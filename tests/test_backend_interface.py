"""Every backend takes every parameter of the `Backend` interface, so `ProcessGroup` can call any of them alike.

`ProcessGroup` passes the same arguments whatever the backend (`out=` for all_gather and reduce_scatter,
split sizes for all_to_all). A backend whose method lacks one fails only when that call is made, which
for the nccl backend means only on a GPU: this checks the signatures here, without one.
"""

from __future__ import annotations

import inspect

import pytest

from axond.distributed.backends import nccl_ops
from axond.distributed.backends.base import Backend
from axond.distributed.backends.mock import MockBackend
from axond.distributed.backends.nccl import NcclBackend
from axond.distributed.backends.tcp import TcpBackend


def params(fn: object, skip: int = 1) -> list[tuple[str, object]]:
    """(name, default) of `fn`'s parameters after the first `skip` (self, or the backend)."""
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[skip:]]  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [TcpBackend, NcclBackend, MockBackend], ids=["tcp", "nccl", "mock"])
@pytest.mark.parametrize("method", sorted(Backend.__abstractmethods__))
def test_a_backend_method_takes_the_interface_parameters(backend: type[Backend], method: str) -> None:
    want = params(getattr(Backend, method))
    got = params(getattr(backend, method))
    assert got[: len(want)] == want, f"{backend.__name__}.{method}{got} does not take Backend.{method}{want}"


@pytest.mark.parametrize("op", sorted(NcclBackend._ASYNC_OPS))
def test_every_async_nccl_op_has_an_op_function_taking_the_method_parameters(op: str) -> None:
    """`NcclBackend.start(op, *args, **kwargs)` calls `nccl_ops.<op>(backend, *args, **kwargs)`."""
    assert params(getattr(nccl_ops, op)) == params(getattr(NcclBackend, op))
