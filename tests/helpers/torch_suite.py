"""Runs torch's own distributed tests (`DistributedTest._DistTestBase`, shipped in the torch wheel) on one
backend at one world size, with forked ranks, and writes each test's outcome as JSON.

    python tests/helpers/torch_suite.py --backend axond --world-size 2 --out results.json [--cpu | --ci | TEST ...]

One process per (backend, world size): the suite reads BACKEND and WORLD_SIZE when its module is imported
(its skip decorators are decided then). With no TEST names it runs every test of the class (those needing a GPU
skip); `--cpu` runs the 91 that run on a CPU-only machine (CPU_TESTS), `--ci` the sample CI runs
(`ci_sample()`). torch's wheel file is not changed: its source is loaded under another module
name after three textual changes, so that "axond" is asked every question gloo is asked:

- `BACKEND == "gloo"` / `BACKEND != "gloo"` become membership tests of (gloo, axond);
- `require_backend_is_available({"gloo"})` also admits axond;
- "axond" joins `DistTestCases.backend_feature` ("gpu", "cuda", "ddp", "subgroup", "plugin"), as gloo is
  in all but "plugin" (which is how torch's suite recognises a third-party backend).

Ranks are forked from this process (torch's own driver spawns them, 30-60 s of imports per test on a busy
two-core machine); each test's ranks are killed after `--test-timeout` seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
import unittest
from typing import Any

GLOO_LIKE = ("gloo", "axond")
"""The backends a rewritten suite treats as gloo (a rank's BACKEND is one of these)."""

REWRITES = (
    ('BACKEND == "gloo"', "BACKEND in _GLOO_LIKE"),
    ('BACKEND != "gloo"', "BACKEND not in _GLOO_LIKE"),
    ('require_backend_is_available({"gloo"})', 'require_backend_is_available({"gloo", "axond"})'),
)
"""The textual changes made to torch's distributed_test.py source before it is loaded."""

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"

CPU_TESTS = (
    "test_Backend_enum_class", "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook", "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view", "test_all_gather", "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_all_gather_complex", "test_all_gather_full_group",
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max", "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product", "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_max", "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_product", "test_all_reduce_coalesced_sum",
    "test_all_reduce_complex_unsupported_ops", "test_all_reduce_full_group_max", "test_all_reduce_full_group_min",
    "test_all_reduce_full_group_product", "test_all_reduce_full_group_sum", "test_all_reduce_max",
    "test_all_reduce_min", "test_all_reduce_product", "test_all_reduce_sum", "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex", "test_barrier", "test_barrier_full_group", "test_barrier_timeout_full_group",
    "test_barrier_timeout_global", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_broadcast", "test_broadcast_full_group", "test_ddp_create_graph", "test_ddp_logging_data_cpu",
    "test_destroy_full_group", "test_destroy_group", "test_dump_DDP_relevant_env_vars", "test_gather",
    "test_gather_checks", "test_gather_full_group", "test_get_backend", "test_get_future", "test_get_rank",
    "test_get_rank_size_full_group", "test_get_rank_size_group", "test_grads_same_across_ranks_with_no_sync",
    "test_irecv", "test_isend", "test_isend_autograd_profiler", "test_isend_torch_profiler",
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup", "test_reduce_full_group_max", "test_reduce_full_group_min",
    "test_reduce_full_group_product", "test_reduce_full_group_sum", "test_reduce_max", "test_reduce_min",
    "test_reduce_product", "test_reduce_sum", "test_reduce_sum_twice", "test_scatter", "test_scatter_checks",
    "test_scatter_complex", "test_scatter_full_group", "test_scatter_object_list", "test_send_recv",
    "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler", "test_send_recv_autograd_profiler", "test_send_recv_torch_profiler",
    "test_send_recv_with_tag", "test_send_recv_with_tag_autograd_profiler", "test_send_recv_with_tag_torch_profiler",
    "test_sparse_all_reduce_sum", "test_static_graph_api_cpu",
)
"""The tests of the suite that run on a CPU-only machine at world size 2 or 3 (torch 2.13.0: the others skip for
want of GPUs, of world size 4, or of another backend); what `--cpu` runs."""

CATEGORIES = (
    ("point-to-point", r"send|recv"),
    ("coalesced", r"coalesced"),
    ("object", r"object"),
    ("DDP", r"DistributedDataParallel|ddp|accumulate_gradients|grads_same|static_graph"),
    ("collectives", r"^test_(all_reduce|reduce|broadcast|all_gather|gather|scatter|sparse)"),
    ("groups, barriers and the rest", r""),
)
"""Each CPU test belongs to the first category whose pattern it matches."""

SAMPLE_SEED, SAMPLE_PER_CATEGORY = 38, 4

WATCHED = (
    "test_all_gather_coalesced_complex", "test_all_gather_coalesced_full_group", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout", "test_monitored_barrier_gloo_subgroup",
    "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler", "test_sparse_all_reduce_sum",
)
"""Tests that passed on gloo and failed on "axond" when this runner was first run: always in the CI sample."""


def category(name: str) -> str:
    return next(label for label, pattern in CATEGORIES if re.search(pattern, name))


def ci_sample() -> list[str]:
    """What CI runs: SAMPLE_PER_CATEGORY tests of each category, drawn from CPU_TESTS with random.Random(SAMPLE_SEED),
    and every WATCHED test; by category, then name."""
    rng = random.Random(SAMPLE_SEED)
    picked: list[str] = []
    for label, _ in CATEGORIES:
        members = [name for name in CPU_TESTS if category(name) == label]
        drawn = set(rng.sample(members, min(SAMPLE_PER_CATEGORY, len(members))))
        picked += sorted(drawn | {name for name in WATCHED if category(name) == label})
    return picked


SCRATCH: list[str] = []
"""Directories load_suite made (the init file, torch's TEMP_DIR): removed when the runner ends."""


def load_suite(backend: str, world_size: int, test_timeout: int) -> types.ModuleType:
    """torch's distributed_test module, rewritten as the module docstring says, for `backend` at `world_size`."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    here = tempfile.mkdtemp(prefix="axond-torch-suite-")
    SCRATCH.append(here)
    os.environ.setdefault("TEMP_DIR", here)
    os.environ["INIT_METHOD"] = f"file://{here}/shared_init_file"  # as torch's CI's file:// runs (barrier timeouts)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(test_timeout)
    import axond.torch  # noqa: F401 -- registers "axond" in this process and so in every forked rank
    import torch._dynamo  # noqa: F401 -- DDP imports it when first built: ~1.5 s in every forked rank otherwise
    from torch.testing._internal import common_distributed

    for feature in ("gpu", "cuda", "ddp", "subgroup", "plugin"):
        common_distributed.DistTestCases.backend_feature[feature].add("axond")
    common_distributed.TIMEOUT_DEFAULT = test_timeout
    spec = importlib.util.find_spec(SUITE_MODULE)
    assert spec is not None and spec.origin is not None, f"{SUITE_MODULE} is not in this torch"
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for old, new in REWRITES:
        assert old in source, f"{old!r} is no longer in {spec.origin}: update REWRITES"
        source = source.replace(old, new)
    module = types.ModuleType("axond_torch_distributed_test")
    module.__file__ = spec.origin
    module._GLOO_LIKE = GLOO_LIKE  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)  # not our __future__s
    return module


def suite_class(module: types.ModuleType) -> type[unittest.TestCase]:
    """torch's TestDistBackend + _DistTestBase, with each test's ranks forked from this process."""
    import torch.multiprocessing

    base: Any = module.TestDistBackend

    class TorchSuite(base, module.DistributedTest._DistTestBase):  # type: ignore[misc, name-defined]
        def setUp(self) -> None:
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    return TorchSuite


def all_tests(cls: type[unittest.TestCase]) -> list[str]:
    """Every test method of the suite class, sorted."""
    return sorted(name for name in dir(cls) if name.startswith("test_"))


class _Recorder(unittest.TestResult):
    """Each test's outcome (pass, fail, skip), its time and, for a failure or skip, the reason's last lines."""

    def __init__(self, progress: Any) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._began = 0.0
        self._progress = progress

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._began = time.monotonic()

    def _note(self, test: unittest.TestCase, status: str, reason: str = "") -> None:
        name = test.id().split(".")[-1]
        seconds = round(time.monotonic() - self._began, 2)
        self.outcomes[name] = {"status": status, "seconds": seconds, "reason": reason}
        print(f"{status:4} {seconds:7.2f}s {name}", file=self._progress, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._note(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._note(test, "fail", _reason(_text(err)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._note(test, "fail", _reason(_text(err)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._note(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._note(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._note(test, "fail", "unexpected success")


def _text(err: Any) -> str:
    """An exc_info triple as its traceback text."""
    return "".join(traceback.format_exception(*err))


def _reason(text: str) -> str:
    """The informative tail of a failure: the child's exception lines, or the parent's last lines."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line.strip() for line in lines if "Error" in line or "Exception" in line or "exited" in line]
    return " | ".join((errors or lines)[-3:])[:600]


def run(backend: str, world_size: int, names: list[str], test_timeout: int, progress: Any) -> dict[str, Any]:
    """Run `names` (every test if empty) and return {"tests": {name: outcome}, "seconds": total}."""
    cls = suite_class(load_suite(backend, world_size, test_timeout))
    names = names or all_tests(cls)
    suite = unittest.TestSuite(cls(name) for name in names)
    recorder = _Recorder(progress)
    began = time.monotonic()
    suite.run(recorder)
    return {"backend": backend, "world_size": world_size, "seconds": round(time.monotonic() - began, 1),
            "tests": recorder.outcomes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON file for the outcomes")
    parser.add_argument("--test-timeout", type=int, default=60, help="seconds before a test's ranks are killed")
    parser.add_argument("--log", help="file for the ranks' own output (default: this process's)")
    parser.add_argument("--cpu", action="store_true", help="run CPU_TESTS (the tests that run without GPUs)")
    parser.add_argument("--ci", action="store_true", help="run the CI sample (ci_sample())")
    parser.add_argument("tests", nargs="*", help="test names (default: all)")
    args = parser.parse_args()
    names = list(CPU_TESTS) if args.cpu else ci_sample() if args.ci else args.tests
    progress = os.fdopen(os.dup(2), "w")
    if args.log:
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        result = run(args.backend, args.world_size, names, args.test_timeout, progress)
    finally:
        for path in SCRATCH:
            shutil.rmtree(path, ignore_errors=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
