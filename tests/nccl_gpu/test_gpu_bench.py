"""bench/gpu.py, the one GPU check: its CPU half (arguments, plan, tables, pytest summary) and its no-GPU exit."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)
import gpu  # noqa: E402


def test_the_plan_runs_every_section_within_five_minutes() -> None:
    steps = gpu.plan(gpu.parse_args([]), gpus=1)
    assert [s.section for s in steps] == list(gpu.SECTIONS)
    assert sum(s.timeout for s in steps) < 300
    two = next(s for s in steps if s.section == "two_ranks")
    assert two.ranks == 2 and two.devices == (0, 0)  # two ranks share GPU 0: NCCL cannot run there
    assert all(s.devices == (0,) * s.ranks for s in steps)


def test_only_and_quick_narrow_the_run() -> None:
    args = gpu.parse_args(["--only", "ddp", "per_call", "--quick"])
    assert [s.section for s in gpu.plan(args, 1)] == ["per_call", "ddp"]
    assert (args.iters, args.steps) == (100, 5)


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--iters", "3"], ["--steps", "1"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        gpu.parse_args(argv)
    assert info.value.code == gpu.EXIT_USAGE


def test_pytest_summary_reads_the_last_line() -> None:
    out = "....s\nFAILED tests/x.py::t\n3 passed, 1 failed, 2 skipped, 1 error, 5 deselected in 4.20s\n"
    assert gpu.pytest_summary(out) == {"passed": 3, "failed": 1, "skipped": 2, "error": 1, "deselected": 5}
    assert gpu.pytest_summary("no tests ran") == {}


def test_tables_render_each_section_and_failures() -> None:
    text = gpu.render("per_call", {"rows": [{"path": "torch nccl", "small_us": 17.71, "large_us": 23.0,
                                             "large_gbs": 2918.4}, {"path": "axond | CuPy"}]})
    lines = text.splitlines()
    assert lines[0] == "### all_reduce per call (world of one)"
    assert lines[4] == "| torch nccl | 17.7 | 23 | 2918 |"
    assert lines[5] == "| axond / CuPy | - | - | - |"  # a '|' in a cell does not break the table
    failed = gpu.render("ddp", {"error": "ddp did not finish within 60s"})
    assert "FAILED" in failed and "within 60s" in failed
    cases: list[tuple[str, dict[str, Any]]] = [("pytest", {"counts": {"passed": 15}, "seconds": 25.0}),
                            ("blocking", {"kernel_ms": 21.7, "rows": [{"path": "a", "host_ms": 0.3, "correct": True}]}),
                            ("ddp", {"rows": [{"backend": "nccl", "ms": 1.66, "ratio": 1.0}]}),
                            ("two_ranks", {"rows": [{"path": "gloo", "ms": 0.9, "correct": True}]})]
    for section, result in cases:
        assert gpu.render(section, result).startswith("### ")


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_without_a_gpu_it_exits_3_saying_why() -> None:
    done = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--only", "ddp", "--quick"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != gpu.EXIT_NO_GPU and gpu.gpu_count()[0]:
        pytest.skip("this machine has a GPU: bench/gpu.py ran for real")
    assert done.returncode == gpu.EXIT_NO_GPU == 3
    assert "needs a CUDA GPU" in done.stderr and "Nothing ran" in done.stderr
    assert done.stdout == ""


def test_every_planned_section_has_its_rank_code() -> None:
    import gpu_ranks

    assert set(gpu_ranks.SECTIONS) == {s.section for s in gpu.plan(gpu.parse_args([]), 1) if s.ranks}
