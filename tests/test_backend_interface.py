"""Every backend implements the whole `Backend` interface, and `ProcessGroup` uses nothing outside it.

`ProcessGroup` passes the same arguments whatever the backend (`out=` for all_gather and reduce_scatter,
split sizes for all_to_all). A backend whose method lacks one fails only when that call is made, which
for the nccl backend means only on a GPU: this checks the signatures here, without one. The optional
capabilities (`post_send`, `batch_p2p`, `start`) have defaults, checked on the mock backend.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import axond.distributed.process_group as process_group
from axond.distributed.backends.base import Backend, op_methods
from axond.distributed.backends.nccl import NcclBackend, ops
from axond.distributed.backends.registry import backend_classes
from axond.distributed.process_group import ProcessGroup
from axond.testing import run_threads

BACKENDS = backend_classes()
METHODS = sorted(name for name, value in vars(Backend).items() if inspect.isfunction(value) and not name.startswith("_"))
"""Every method the interface declares (abstract or with a default)."""


def params(fn: object, skip: int = 1) -> list[tuple[str, object]]:
    """(name, default) of `fn`'s parameters after the first `skip` (self, or the backend)."""
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[skip:]]  # type: ignore[arg-type]


def unbuilt(cls: type[Backend]) -> Backend:
    """An instance of `cls` without running its constructor (no sockets, no GPU): enough to bind its methods."""
    return object.__new__(cls)


def test_the_registry_holds_every_backend() -> None:
    assert sorted(BACKENDS) == ["mock", "nccl", "tcp"]
    assert BACKENDS["nccl"] is NcclBackend


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_registered_backend_implements_every_abstract_method(name: str) -> None:
    cls = BACKENDS[name]
    assert issubclass(cls, Backend) and not inspect.isabstract(cls), f"{cls.__name__}: {sorted(cls.__abstractmethods__)}"
    assert cls.name == name


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("method", METHODS)
def test_a_backend_method_takes_the_interface_parameters(name: str, method: str) -> None:
    backend = BACKENDS[name]
    want = params(getattr(Backend, method))
    got = params(getattr(backend, method))
    assert got[: len(want)] == want, f"{backend.__name__}.{method}{got} does not take Backend.{method}{want}"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_op_runs_a_method_of_the_interface(name: str) -> None:
    for op, method in op_methods(unbuilt(BACKENDS[name])).items():
        assert method.__name__ in METHODS, f"op {op!r} runs {method.__name__}, which Backend does not declare"


def test_every_async_nccl_op_has_a_launch_function_taking_the_method_parameters() -> None:
    """`NcclBackend.start(op, *args, **kwargs)` calls `ops.LAUNCHES[op](backend, *args, **kwargs)`."""
    methods = op_methods(unbuilt(NcclBackend))
    assert sorted(ops.LAUNCHES) == sorted(methods)
    for op, launch in ops.LAUNCHES.items():
        assert params(launch) == params(methods[op], skip=0), op


def uses_of_the_backend() -> tuple[set[str], set[str], list[str]]:
    """(attributes of the backend, op names, getattr/hasattr calls) found in `process_group.py`'s source."""
    tree = ast.parse(Path(process_group.__file__).read_text())
    attributes: set[str] = set()
    op_names: set[str] = set()
    probes: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("backend", "impl")) or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "backend"):
                attributes.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            probes.append(ast.unparse(node))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("_run", "start") \
                and node.args and isinstance(node.args[0], ast.Constant):
            op_names.add(node.args[0].value)
    return attributes, op_names, probes


def test_the_process_group_uses_nothing_outside_the_interface() -> None:
    attributes, op_names, probes = uses_of_the_backend()
    constructed = {"store", "rank", "size", "group_name", "options"}  # set by Backend.__init__
    declared = set(METHODS) | constructed | {"name"}
    assert attributes and attributes <= declared, f"ProcessGroup uses {sorted(attributes - declared)} of the backend"
    assert op_names and op_names <= set(op_methods(unbuilt(BACKENDS["mock"]))), sorted(op_names)
    assert not probes, f"ProcessGroup probes by name: {probes}"


def test_the_defaults_send_then_batch_and_leave_async_ops_to_the_group() -> None:
    """On the mock backend (no overrides): `post_send` sends and returns None, `batch_p2p` does not deadlock when
    both ranks list their irecv first, and `start` launches nothing."""
    def body(g: ProcessGroup) -> list[float]:
        b = g.backend
        assert b is not None
        peer = 1 - g.rank
        assert b.start("all_reduce", np.ones(2), None) is None
        assert b.post_send(np.full(3, 10.0 + g.rank), peer, 5) is None
        first = np.zeros(3)
        b.recv(first, peer, 5)
        got = np.zeros(2)
        b.batch_p2p([("irecv", got, peer, 7), ("isend", np.full(2, float(g.rank)), peer, 7)])
        return [float(first[0]), float(got[0])]
    assert run_threads(body, 2, backend="mock", timeout=20.0) == [[11.0, 1.0], [10.0, 0.0]]
