"""Where a test module lives: tests/<subsystem>/ by the first rule its file name matches; helpers in tests/helpers/.

    python tests/place_tests.py            # print `git mv` commands for every flat file of tests/ (nothing moved)
    python tests/place_tests.py --apply    # run them
    python tests/place_tests.py FILE ...   # the same for the named files only

Test modules (`test_*.py`) go to the folder of the first matching pattern below (fnmatch on the basename);
every other module (rank bodies, fixtures, scripts the tests run by path) goes to tests/helpers/, which
pyproject's `pythonpath` puts on sys.path, so tests keep importing helpers by bare module name. Basenames
stay unique across folders (pytest imports test modules by basename).
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

RULES: list[tuple[str, str]] = [
    # GPU, NCCL and their CPU halves (bench/gpu.py runs `pytest -m gpu`).
    ("test_*_gpu.py", "nccl_gpu"),
    ("test_gpu_*.py", "nccl_gpu"),
    ("test_nccl_*.py", "nccl_gpu"),
    # The repository's own quality: docs, lint, types, imports, packaging, contract, generated stubs.
    ("test_docs.py", "docs_quality"),
    ("test_lint.py", "docs_quality"),
    ("test_typecheck.py", "docs_quality"),
    ("test_import_graph.py", "docs_quality"),
    ("test_packaging.py", "docs_quality"),
    ("test_contract_surface.py", "docs_quality"),
    ("test_proto_drift.py", "docs_quality"),
    ("test_tuning_doc.py", "docs_quality"),
    ("test_layout_doc.py", "docs_quality"),
    ("test_mailbox_layout.py", "docs_quality"),
    ("test_tests_*.py", "docs_quality"),
    # Clusters and deployments: slurm, network namespaces, kubernetes, compose/docker.
    ("test_slurm*.py", "cluster"),
    ("test_netns_*.py", "cluster"),
    ("test_kubernetes*.py", "cluster"),
    ("test_compose*.py", "cluster"),
    ("test_docker*.py", "cluster"),
    # torch.distributed backend, torchrun, frameworks.
    ("test_torch*.py", "torch"),
    # The coordinator (server, state machine, persistence, etcd) and the control plane's clients.
    ("test_coordinator_*.py", "coordinator"),
    ("test_etcd_*.py", "coordinator"),
    ("test_join_refusals.py", "coordinator"),
    ("test_heartbeat_*.py", "coordinator"),
    ("test_secure_defaults.py", "coordinator"),
    ("test_control_*.py", "control"),
    ("test_latency.py", "control"),
    # Worker daemon and launcher.
    ("test_worker*.py", "worker"),
    ("test_standalone.py", "worker"),
    # Observability and the CLI.
    ("test_metrics*.py", "observe"),
    ("test_timeline*.py", "observe"),
    ("test_observe*.py", "observe"),
    ("test_cli*.py", "cli"),
    # Stores and init_process_group.
    ("test_config*.py", "init"),
    ("test_init*.py", "init"),
    ("test_*store*.py", "init"),
    # The tcp backend: sockets, shared memory, mailbox, single-copy, host copies, two-level, policy.
    ("test_tcp*.py", "tcp"),
    ("test_shm*.py", "tcp"),
    ("test_mailbox*.py", "tcp"),
    ("test_single_copy*.py", "tcp"),
    ("test_host_copy*.py", "tcp"),
    ("test_shared_arrays*.py", "tcp"),
    ("test_spread*.py", "tcp"),
    ("test_hierarchy*.py", "tcp"),
    ("test_mesh_*.py", "tcp"),
    ("test_bench_*.py", "tcp"),
    # Checkpoints, training, nn.
    ("test_checkpoint*.py", "checkpoint"),
    ("test_trainer*.py", "train"),
    ("test_example*.py", "train"),
    ("test_nn_*.py", "nn"),
    # Parallel wrappers: DDP (and hooks), FSDP, ZeRO, pipeline, tensor parallel, parameter server, meshes.
    ("test_ddp*.py", "parallel"),
    ("test_fsdp*.py", "parallel"),
    ("test_zero*.py", "parallel"),
    ("test_pipeline*.py", "parallel"),
    ("test_tensor_parallel*.py", "parallel"),
    ("test_parameter_server*.py", "parallel"),
    ("test_powersgd*.py", "parallel"),
    ("test_device_mesh*.py", "parallel"),
    ("test_mixed_precision*.py", "parallel"),
    ("test_memory*.py", "parallel"),
    ("test_sampler*.py", "parallel"),
    # Collectives and the generic group API over any backend (the default for what is left).
    ("test_*.py", "collectives"),
]
"""(basename pattern, folder), first match wins."""

RENAMED = {"test_worker_support.py": "worker_support.py"}
"""Helpers whose name looked like a test module."""

STAY = {"conftest.py", "place_tests.py"}


def destination(name: str) -> str:
    """Where tests/<name> belongs, relative to tests/."""
    if name in RENAMED:
        return f"helpers/{RENAMED[name]}"
    if not name.startswith("test_"):
        return f"helpers/{name}"
    for pattern, folder in RULES:
        if fnmatch.fnmatch(name, pattern):
            return f"{folder}/{name}"
    raise AssertionError("unreachable: the last rule matches every test module")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="flat files under tests/ (default: all)")
    parser.add_argument("--apply", action="store_true", help="run the `git mv` commands")
    args = parser.parse_args(argv)
    names = [Path(f).name for f in args.files] or sorted(p.name for p in TESTS.glob("*.py"))
    for name in names:
        if name in STAY:
            continue
        target = TESTS / destination(name)
        if target.exists():
            print(f"tests/{target.relative_to(TESTS)} exists already", file=sys.stderr)
            return 1
        cmd = ["git", "mv", f"tests/{name}", f"tests/{target.relative_to(TESTS)}"]
        print(" ".join(cmd))
        if args.apply:
            target.parent.mkdir(exist_ok=True)
            subprocess.run(cmd, cwd=TESTS.parent, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
