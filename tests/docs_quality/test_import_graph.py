"""The import graph stays as the architecture draws it.

- The generic backend interface and the rest of `axond.distributed` import nothing of the tcp backend (only the
  registry names it, by module path, and loads it when asked for).
- No new function-local `axond` import: such imports hide loops between packages. The ones there were when this
  test was written are listed in ALLOWED (file, module imported); a new one fails here. Entries whose import has
  gone may be deleted (the list only shrinks).
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

ALLOWED: set[tuple[str, str]] = {
    ("axond/checkpoint/api.py", "axond.distributed"),
    ("axond/checkpoint/api.py", "axond.distributed.objects"),
    ("axond/cli/coordinator_cmd.py", "axond.coordinator.limits"),
    ("axond/cli/coordinator_cmd.py", "axond.coordinator.server"),
    ("axond/cli/slurm_cmd.py", "axond.coordinator.server"),  # as worker_cmd: the daemon loads only when it runs
    ("axond/cli/worker_cmd.py", "axond.coordinator.server"),
    ("axond/distributed/backends/host_copy.py", "axond.distributed.backends"),  # the optional compiled helper
    ("axond/distributed/failure.py", "axond.distributed"),
    ("axond/distributed/init_method.py", "axond.control"),
    ("axond/distributed/init_method.py", "axond.distributed.file_store"),
    ("axond/distributed/init_method.py", "axond.distributed.tcp_store"),
    ("axond/distributed/init_method.py", "axond.errors"),
    ("axond/distributed/tensor_args.py", "axond.torch.arguments"),
    ("axond/distributed/torch_forms.py", "axond.distributed.process_group"),
    ("axond/nn/grad_scaler.py", "axond.distributed"),
    ("axond/nn/grad_scaler.py", "axond.distributed.reduce_op"),
    ("axond/parallel/ddp/buckets.py", "axond.parallel.ddp.hooks"),
    ("axond/parallel/ddp/comm.py", "axond.distributed"),
    ("axond/parallel/fsdp/comm.py", "axond.distributed"),
    ("axond/parallel/fsdp/offload.py", "axond.parallel.fsdp.offload_cuda"),
    ("axond/parallel/memory.py", "axond.parallel.fsdp.wrap"),
    ("axond/parallel/pipeline/pipeline.py", "axond.distributed"),
    ("axond/parallel/pipeline/pipeline.py", "axond.parallel.memory"),
    ("axond/parallel/sampler.py", "axond.distributed"),
    ("axond/parallel/tensor/comm.py", "axond.distributed"),
    ("axond/testing/processes.py", "axond"),
    ("axond/torch/__init__.py", "axond.torch.cuda_process_group"),
    ("axond/torch/devices.py", "axond.distributed.backends.nccl"),
    ("axond/train/clip.py", "axond.checkpoint.adapters"),
    ("axond/train/trainer.py", "axond.distributed"),
    ("coordinator/server.py", "axond.coordinator.persistence.etcd"),
    ("coordinator/server.py", "axond.coordinator.replica"),
    ("worker/spec.py", "axond.control.channel"),
    ("worker/spec.py", "axond.control.client"),
    ("worker/spec.py", "axond.control.credentials"),
}
"""(file, module) of every function-local import of an axond module the tree has: to be inverted, not added to."""


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
    """Every function-local import of an axond module is on the allow-list."""
    found = {(rel, module) for rel, tree in _sources() for module in _local_imports(rel, tree)}
    new = sorted(found - ALLOWED)
    assert not new, ("function-local imports of axond modules hide loops; import at the top (and invert the "
                     f"dependency if that makes a loop): {new}")


def test_the_generic_layers_import_nothing_of_tcp() -> None:
    """backends/base.py, the registry, the mock backend, ops.py and the rest of axond.distributed import no module of
    the tcp backend, at the top or in a function."""
    offenders = [(rel, module) for rel, tree in _sources()
                 if rel.startswith("axond/distributed/") and not rel.startswith("axond/distributed/backends/tcp/")
                 for module in _all_imports(rel, tree) if module == TCP or module.startswith(TCP + ".")]
    assert not offenders, offenders


def test_the_allow_list_scanner_sees_a_local_import() -> None:
    """The scanner finds a function-local import, relative or absolute, and ignores top-level ones."""
    tree = ast.parse("import axond\n\ndef f():\n    from axond.errors import DistributedError\n"
                     "    from . import ops\n    import numpy\n")
    assert sorted(_local_imports("axond/distributed/x.py", tree)) == ["axond.distributed", "axond.errors"]
