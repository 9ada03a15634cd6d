"""The import graph stays as the architecture draws it.

- The generic backend interface and the rest of `axond.distributed` import nothing of the tcp backend (only the
  registry names it, by module path, and loads it when asked for).
- The layers the package docstrings and docs/design/layout.md draw: the coordinator's state machine (`state/`) knows
  nothing of gRPC or the service above it; `ops.py` and `numerics/` are leaves; the backends sit below the groups.
- No new function-local `axond` import: such imports hide loops between packages. The few left load an optional or
  heavy dependency only when used, each listed in ALLOWED with its reason (at most MAX_LOCAL).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("axond", "coordinator", "worker")
GENERATED = ("axond/v1/", "axond/etcdv3/")
TCP = "axond.distributed.backends.tcp"

ALLOWED: dict[tuple[str, str], str] = {
    ("axond/cli/coordinator_cmd.py", "axond.coordinator.server"): "the coordinator (gRPC) loads only when it runs",
    ("axond/cli/coordinator_cmd.py", "axond.coordinator.limits"): "as the server: `axond --help` loads no coordinator",
    ("axond/cli/slurm_cmd.py", "axond.coordinator.server"): "as coordinator_cmd: loaded only when it runs",
    ("axond/cli/worker_cmd.py", "axond.coordinator.server"): "a worker starts a coordinator only with --standalone",
    ("axond/distributed/backends/host_copy.py", "axond.distributed.backends"): "the optional compiled helper",
    ("axond/parallel/fsdp/offload.py", "axond.parallel.fsdp.offload_cuda"): "CUDA offload: CuPy only when asked for",
    ("axond/store/init_methods.py", "axond.control"): "gRPC loads only for a coordinator's store",
    ("axond/torch/__init__.py", "axond.torch.cuda_process_group"): "CUDA tensors: only where torch sees a GPU",
    ("axond/torch/devices.py", "axond.distributed.backends.nccl"): "the NCCL backend: CuPy only where it can run",
    ("axond/torch/autoload/__init__.py", "axond.torch"): "torch's autoload hook: axond loads at the first group",
}
"""(file, module) of every function-local import of an axond module -> why it is one: an optional or heavy dependency
loaded only when used. No runtime loop hides here (`default_registry`, the converter registry of `forms.tensor_args`
and the registry of backends replace those); at most MAX_LOCAL entries, each still in the tree."""
MAX_LOCAL = 10


@functools.cache
def _sources() -> tuple[tuple[str, ast.Module], ...]:
    """Every source file of the packages (generated code aside), parsed once for all tests."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                found.append((rel, ast.parse(path.read_text(), rel)))
    return tuple(found)


def _module(rel: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The absolute modules `node` imports in file `rel` (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        return [node.module or ""]
    package = rel[:-3].split("/")[: -node.level] if not rel.endswith("__init__.py") else rel.split("/")[:-node.level]
    return [".".join([*package, *([node.module] if node.module else [])])]


def _local_imports(rel: str, tree: ast.Module) -> Iterator[str]:
    """Modules of axond, coordinator or worker imported inside a function of `tree`."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for module in _module(rel, node):
                        if module.split(".")[0] in PACKAGES:
                            yield module


def _all_imports(rel: str, tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _module(rel, node)


def test_no_new_function_local_axond_import() -> None:
    """Every function-local import of an axond module is on the allow-list with its reason; the list has at most
    MAX_LOCAL entries and none whose import is gone."""
    found = {(rel, module) for rel, tree in _sources() for module in _local_imports(rel, tree)}
    new = sorted(found - set(ALLOWED))
    assert not new, ("function-local imports of axond modules hide loops; import at the top (and invert the "
                     f"dependency if that makes a loop): {new}")
    assert not set(ALLOWED) - found, f"delete the allow-list entries whose import is gone: {set(ALLOWED) - found}"
    assert len(ALLOWED) <= MAX_LOCAL and all(ALLOWED.values())


def test_the_generic_layers_import_nothing_of_tcp() -> None:
    """backends/base.py, the registry, the mock backend, ops.py and the rest of axond.distributed import no module of
    the tcp backend, at the top or in a function."""
    offenders = [(rel, module) for rel, tree in _sources()
                 if rel.startswith("axond/distributed/") and not rel.startswith("axond/distributed/backends/tcp/")
                 for module in _all_imports(rel, tree) if module == TCP or module.startswith(TCP + ".")]
    assert not offenders, offenders


def _names(rel: str, tree: ast.Module) -> Iterator[str]:
    """Every module `tree` imports, and for `from M import n` also `M.n` (n may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module in _module(rel, node):
                yield module
                if isinstance(node, ast.ImportFrom):
                    yield from (f"{module}.{alias.name}" for alias in node.names)


def _offenders(folder: str, banned: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file, module) of every import, under `folder`, of a module in or under one of `banned`."""
    return sorted({(rel, name) for rel, tree in _sources() if rel.startswith(folder) for name in _names(rel, tree)
                   if any(name == b or name.startswith(b + ".") for b in banned)})


BACKEND_NAMES = ("tcp", "nccl", "mock", "staging", "gpu-auto")
"""The registered backends' names (`registry._MODULES`)."""
DEVICE_ROUTING = ("axond/torch/devices.py",)
"""Where torch's CUDA tensors are sent to the NCCL backend when it can run (`devices_here`): a device, not a choice."""


def test_the_torch_backend_names_no_backend() -> None:
    """axond/torch runs over whichever axond backend its groups were given (AXOND_TORCH_BACKEND, else the registry's
    default): it imports no backend's package and spells no backend's name."""
    backends = tuple(f"axond.distributed.backends.{name}" for name in ("tcp", "nccl", "mock"))
    offenders = [(rel, name) for rel, tree in _sources() if rel.startswith("axond/torch/") and rel not in DEVICE_ROUTING
                 for name in _names(rel, tree) if any(name == b or name.startswith(b + ".") for b in backends)]
    offenders += [(rel, node.value) for rel, tree in _sources()
                  if rel.startswith("axond/torch/") and rel not in DEVICE_ROUTING for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES]
    assert not offenders, offenders


def test_the_coordinator_state_machine_knows_nothing_of_grpc() -> None:
    """coordinator/state/ (the state machine) imports neither grpc, the protos, nor the service or the server above
    it: tests drive it with plain calls and an explicit `now`."""
    assert not _offenders("coordinator/state/", ("grpc", "axond.v1", "axond.coordinator.service",
                                                 "axond.coordinator.server", "axond.coordinator.replica"))


def test_the_coordinator_state_owns_its_storage_port() -> None:
    """coordinator/state/ (the state machine, its journal and its port `state/port.py`) imports nothing of
    persistence/: the stores implement the port and import the state, never the reverse."""
    assert not _offenders("coordinator/state/", ("axond.coordinator.persistence",))


def test_server_and_replica_do_not_import_each_other() -> None:
    """The replica builds its servers from what it shares with the server (`config.py`, `serving.py`), not from
    server.py; server.py starts a replica, so the replica must not import it back (nor config or serving either)."""
    assert not _offenders("coordinator/replica.py", ("axond.coordinator.server",))
    for shared in ("coordinator/config.py", "coordinator/serving.py"):
        assert not _offenders(shared, ("axond.coordinator.server", "axond.coordinator.replica"))


def test_the_vocabulary_and_the_numerics_are_leaves() -> None:
    """ops.py and numerics/ import nothing else of axond: every layer may use them."""
    numerics = "axond.distributed.numerics"
    offenders = sorted({(rel, name) for rel, tree in _sources()
                        if rel == "axond/distributed/ops.py" or rel.startswith("axond/distributed/numerics/")
                        for name in _names(rel, tree) if name.split(".")[0] in PACKAGES
                        and name != numerics and not name.startswith(numerics + ".")})
    assert not offenders


def test_the_backends_sit_below_the_groups() -> None:
    """No backend imports the module functions, ProcessGroup or the call forms built over them."""
    assert not _offenders("axond/distributed/backends/", ("axond.distributed.api", "axond.distributed.process_group",
                                                          "axond.distributed.group_core", "axond.distributed.forms"))


STORE_MAY_IMPORT = ("axond.errors", "axond.config", "axond.store", "axond.control", "axond.v1")
"""What the stores build on: the data plane and torch build on them, never the other way."""


def test_the_stores_sit_below_the_data_plane() -> None:
    """axond/store imports only the errors, the configuration, itself, the coordinator's client (the coordinator's
    store) and the stubs: nothing of axond.distributed, axond.torch or the rest, at the top or in a function."""
    offenders = [(rel, module) for rel, tree in _sources() if rel.startswith("axond/store/")
                 for module in _all_imports(rel, tree) if module.split(".")[0] in PACKAGES
                 and not any(module == m or module.startswith(m + ".") for m in STORE_MAY_IMPORT)]
    assert not offenders, offenders


def test_the_allow_list_scanner_sees_a_local_import() -> None:
    """The scanner finds a function-local import, relative or absolute, and ignores top-level ones."""
    tree = ast.parse("import axond\n\ndef f():\n    from axond.errors import DistributedError\n"
                     "    from . import ops\n    import numpy\n")
    assert sorted(_local_imports("axond/distributed/x.py", tree)) == ["axond.distributed", "axond.errors"]
