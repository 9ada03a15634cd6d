"""The one GPU check: `python bench/gpu.py [--out FILE] [--only SECTION ...] [--quick]`.

On a machine with one or more CUDA GPUs it runs, in under 5 minutes, and prints one markdown table per section:

- `pytest`: the summary of `pytest -m gpu` (tests/);
- `blocking`: host time of a blocking 8-byte all_reduce queued after a long matmul (axond on CuPy arrays, torch's
  `nccl`, torch over `"axond"`), and whether the result is right once the stream is synchronised;
- `per_call`: time per call of an 8-byte all_reduce and bandwidth of a 64 MiB one, for the raw CuPy
  `NcclCommunicator.allReduce`, axond on CuPy arrays, torch's `nccl` and torch over `"axond"`, in one process;
- `ddp`: a torch DDP step (4 x Linear(2048), batch 256) on `nccl` against `"axond"`, and the largest parameter
  difference after the steps;
- `two_ranks`: two ranks sharing GPU 0 (NCCL cannot run there): 1 MiB all_reduce on torch CUDA tensors over gloo,
  over `"axond"` (its staging path), and on CuPy arrays with axond's `auto` backend.

Each section runs in processes of its own (bench/gpu_ranks.py, spawned here with a file store), bounded by a
timeout; a section that fails prints its error in its table and the run goes on. Exit status: 0 every section ran,
1 some section failed, 2 bad arguments, 3 no GPU here (nothing ran; the message says why).
Everything but the spawned ranks is importable without torch, CuPy or a GPU (tests/nccl_gpu/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
SECTIONS = ("pytest", "blocking", "per_call", "ddp", "two_ranks")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Step:
    """One section of the run: how many rank processes it spawns, on which devices, and its time limit."""

    section: str
    ranks: int
    devices: tuple[int, ...]
    timeout: float
    args: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", help="also write the tables to this file")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run, not a measurement)")
    p.add_argument("--iters", type=int, default=2000, help="calls per small-op measurement (default 2000)")
    p.add_argument("--steps", type=int, default=50, help="DDP steps per backend (default 50)")
    args = p.parse_args(argv)
    if args.iters < 10 or args.steps < 3:
        p.error("--iters must be >= 10 and --steps >= 3")
    if args.quick:
        args.iters, args.steps = 100, 5
    return args


def plan(args: argparse.Namespace, gpus: int) -> list[Step]:
    """The sections to run on a machine with `gpus` GPUs, each with its ranks, devices and time limit (< 5 min)."""
    wanted = args.only or list(SECTIONS)
    steps: list[Step] = []
    for section in SECTIONS:
        if section not in wanted:
            continue
        if section == "pytest":
            steps.append(Step("pytest", 0, (), 120.0))
        elif section == "two_ranks":
            steps.append(Step("two_ranks", 2, (0, 0), 45.0, {"iters": max(20, args.iters // 20)}))
        elif section == "ddp":
            steps.append(Step("ddp", 1, (0,), 45.0, {"steps": args.steps}))
        else:
            steps.append(Step(section, 1, (0,), 30.0 if section == "blocking" else 40.0, {"iters": args.iters}))
    return steps


def gpu_count() -> tuple[int, str]:
    """(number of CUDA GPUs visible, why none when 0), asked of torch, else CuPy, in a child process (never
    initialising CUDA in this one, which spawns the ranks)."""
    probe = ("import json\ntry:\n import torch\n n = torch.cuda.device_count(); how = 'torch'\n"
             "except Exception as e:\n n, how = 0, f'torch: {e}'\n"
             "if not n:\n try:\n  import cupy\n  n = cupy.cuda.runtime.getDeviceCount(); how = 'cupy'\n"
             " except Exception as e:\n  how += f'; cupy: {type(e).__name__}: {e}'\n"
             "print(json.dumps([int(n), how]))\n")
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        n, how = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return 0, f"the GPU probe failed ({type(e).__name__})"
    return int(n), ("" if n else f"no CUDA device visible ({how})")


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table under a `###` title; floats with 3 significant digits, None as '-'."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v).replace("|", "/").replace("\n", " ")
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_summary(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line ('3 passed, 1 skipped, 2 deselected in 4.0s')."""
    counts: dict[str, int] = {}
    for line in reversed(output.strip().splitlines()):
        found = _SUMMARY.findall(line)
        if found:
            for n, what in found:
                counts["error" if what.startswith("error") else what] = int(n)
            break
    return counts


def render(section: str, result: dict[str, Any]) -> str:
    """The table of one section from its result (what the ranks reported, or {'error': ...})."""
    if "error" in result:
        return table(f"{section}: FAILED", ["error"], [[result["error"]]])
    if section == "pytest":
        c = result["counts"]
        rows = [[c.get(k, 0) for k in ("passed", "failed", "skipped", "error")] + [result["seconds"]]]
        return table("pytest -m gpu", ["passed", "failed", "skipped", "errors", "seconds"], rows) + (
            "\n" + "\n".join(result.get("failures", [])) + "\n" if result.get("failures") else "")
    if section == "blocking":
        return table(f"blocking 8-byte all_reduce after a {result['kernel_ms']:.1f} ms matmul (host time)",
                     ["path", "host ms until the call returned", "result right after sync"],
                     [[r["path"], r["host_ms"], r["correct"]] for r in result["rows"]])
    if section == "per_call":
        return table("all_reduce per call (world of one)", ["path", "8 B us/call", "64 MiB us/call", "64 MiB GB/s"],
                     [[r["path"], r.get("small_us"), r.get("large_us"), r.get("large_gbs")] for r in result["rows"]])
    if section == "ddp":
        return table("torch DDP step, 4 x Linear(2048), batch 256", ["backend", "median ms/step", "vs nccl",
                                                                     "max |param diff| vs nccl"],
                     [[r["backend"], r["ms"], r["ratio"], r.get("diff")] for r in result["rows"]])
    if section == "two_ranks":
        return table("two ranks on one GPU: 1 MiB all_reduce", ["path", "ms/call", "correct", "note"],
                     [[r["path"], r.get("ms"), r.get("correct"), r.get("note", "")] for r in result["rows"]])
    return table(section, ["result"], [[json.dumps(result)]])


def run_pytest(timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE", "tests"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"pytest -m gpu did not finish within {timeout:.0f}s"}
    output = done.stdout + done.stderr
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    counts = pytest_summary(output)
    if not counts:
        return {"error": f"pytest exited {done.returncode} without a summary: {output[-500:]}"}
    return {"counts": counts, "seconds": time.monotonic() - started, "failures": failures}


def run_ranks(step: Step) -> dict[str, Any]:
    """Spawn `step.ranks` processes of bench/gpu_ranks.py sharing a file store; rank 0's JSON is the result."""
    with tempfile.TemporaryDirectory(prefix="axond-gpu-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for rank in range(step.ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(step.ranks), LOCAL_RANK=str(step.devices[rank]),
                       AXOND_BENCH_DEVICE=str(step.devices[rank]), AXOND_BENCH_STORE=os.path.join(tmp, "store"),
                       PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, os.path.join(HERE, "gpu_ranks.py"), step.section, out, json.dumps(step.args)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + step.timeout
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return {"error": f"{step.section} did not finish within {step.timeout:.0f}s"}
        if any(p.returncode for p in procs) or not os.path.exists(out):
            tail = " // ".join(log.strip().splitlines()[-1] for log in logs if log.strip())
            return {"error": f"{step.section}: ranks exited {[p.returncode for p in procs]}: {tail[-600:]}"}
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gpus, why = gpu_count()
    if gpus < 1:
        print(f"bench/gpu.py needs a CUDA GPU: {why}. Nothing ran (exit {EXIT_NO_GPU}).", file=sys.stderr)
        return EXIT_NO_GPU
    started, failed, text = time.monotonic(), False, [f"## bench/gpu.py on {gpus} GPU(s)\n"]
    for step in plan(args, gpus):
        result = run_pytest(step.timeout) if step.section == "pytest" else run_ranks(step)
        failed = failed or "error" in result
        text.append(render(step.section, result))
        print(text[-1], flush=True)
    text.append(f"total {time.monotonic() - started:.0f} s\n")
    print(text[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text))
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
