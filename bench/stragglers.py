"""Straggler naming (not a test): how soon a slow rank is named, false namings under load, and what recording costs.

    python bench/stragglers.py detect [--runs 3] [--steps 20] [--torch]  # rank 2 busy 200 ms per backward
    python bench/stragglers.py quiet [--steps 1000] [--busy 2] [--torch] # no straggler, `yes > /dev/null` beside
    python bench/stragglers.py cost --tree /work/main [--ops 200000]     # ns per small all_reduce, A/B of two trees

`detect` and `quiet` run `axond worker --standalone --nproc-per-node 4 -- python -m axond.testing.straggler_job`
(native DDP, 18 all_reduces per step; `--torch`: `straggler_torch_job`, torch DDP over "axond", 6) with the
AXOND_STRAGGLER_* settings at their defaults (or as the environment sets them), and read the worker's output as
it comes: `detect` prints the step rank 0 had finished when the worker named the slow rank; `quiet` counts the
worker's straggler notices over a fault-free run with `--busy` busy loops beside it.
`cost` times the recording's statements alone (what each collective runs more), then a blocking 8-float all_reduce on
a one-rank "mock" group in this tree and in `--tree` (one without arrival recording), in alternating rounds, and
prints the median ns per op of each and their difference (noisy on a shared machine: the op itself takes ~10 us).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
STEP = re.compile(r"\[rank 0\] step (\d+)")


def _job(steps: int, env: dict[str, str], torch: bool = False) -> tuple[int, list[tuple[int, str]]]:
    """Run the job; (exit code, [(steps rank 0 had printed, notice line)] for each straggler notice)."""
    cmd = [sys.executable, "-m", "axond", "worker", "--standalone", "--nproc-per-node", "4", "--",
           sys.executable, "-m", f"axond.testing.straggler{'_torch' if torch else ''}_job", str(steps)]
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)
    assert proc.stdout is not None
    step, notices = 0, []
    for line in proc.stdout:
        m = STEP.search(line)
        if m:
            step = int(m.group(1))
        elif "straggler" in line:
            notices.append((step, line.strip()))
    return proc.wait(timeout=60), notices


def detect(args: argparse.Namespace) -> None:
    print(f"{'torch DDP over axond' if args.torch else 'native DDP'}\n")
    print("| run | steps | named at step | notice |\n|---|---|---|---|")
    for run in range(args.runs):
        code, notices = _job(args.steps, {"SLOW_RANK": "2", "SLOW_S": str(args.slow_s)}, args.torch)
        named = [s for s, line in notices if "rank 2 is a straggler" in line]
        first = named[0] if named else "never"
        text = notices[0][1].split("axond worker: ", 1)[-1] if notices else "-"
        print(f"| {run + 1} | {args.steps} (exit {code}) | {first} | {text} |", flush=True)


def quiet(args: argparse.Namespace) -> None:
    loops = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.busy)]
    try:
        t0 = time.monotonic()
        code, notices = _job(args.steps, {}, args.torch)
        wall = time.monotonic() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    print("| job | steps | busy loops | exit | wall s | false namings |\n|---|---|---|---|---|---|")
    named = sum("is a straggler" in n for _, n in notices)
    job = "torch DDP" if args.torch else "native DDP"
    print(f"| {job} | {args.steps} | {args.busy} | {code} | {wall:.0f} | {named} |")
    for step, line in notices:
        print(f"    at step {step}: {line}")


COST = """
import sys, time, numpy as np
from axond.distributed.process_group import ProcessGroup
g = ProcessGroup.mock()
x = np.zeros(8, np.float32)
for _ in range(2000):
    g.all_reduce(x)
n = int(sys.argv[1])
t0 = time.perf_counter_ns()
for _ in range(n):
    g.all_reduce(x)
print((time.perf_counter_ns() - t0) / n)
"""


RECORD = """
start = monotonic_ns()
g.waited_ns += monotonic_ns() - start
g.waited_ops += 1
if g.waited_ops >= g.window_at:
    g.close_window()
"""
"""What `ProcessGroup` adds to each collective (`_run`, `_tracked`, `FastPath.run`), timed alone."""


def _isolated(ops: int) -> float:
    """ns per run of RECORD on a real group (a mark every AXOND_STRAGGLER_WINDOW_OPS ops), the median of 7 repeats."""
    import timeit
    from time import monotonic_ns

    from axond.distributed.process_group import ProcessGroup

    g = ProcessGroup.mock()
    try:
        runs = timeit.repeat(RECORD, repeat=7, number=ops, globals={"g": g, "monotonic_ns": monotonic_ns})
    finally:
        g.destroy()
    return statistics.median(runs) / ops * 1e9


def cost(args: argparse.Namespace) -> None:
    print(f"recording alone, as ProcessGroup runs it per collective: {_isolated(args.ops):.0f} ns\n")
    trees = {"this tree": str(HERE), "--tree": str(Path(args.tree).resolve())}
    times: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, "-c", COST, str(args.ops)], env=env, capture_output=True, text=True,
                                 check=True, cwd=tree)
            times[name].append(float(out.stdout.strip()))
    a, b = statistics.median(times["this tree"]), statistics.median(times["--tree"])
    print("| tree | ns per all_reduce (median of rounds) |\n|---|---|")
    print(f"| this tree (recording) | {a:.0f} |\n| {args.tree} (none) | {b:.0f} |\n| difference | {a - b:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("detect")
    d.add_argument("--runs", type=int, default=3)
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--slow-s", type=float, default=0.2)
    d.add_argument("--torch", action="store_true")
    q = sub.add_parser("quiet")
    q.add_argument("--torch", action="store_true")
    q.add_argument("--steps", type=int, default=1000)
    q.add_argument("--busy", type=int, default=2)
    c = sub.add_parser("cost")
    c.add_argument("--tree", required=True)
    c.add_argument("--ops", type=int, default=200_000)
    c.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    {"detect": detect, "quiet": quiet, "cost": cost}[args.mode](args)


if __name__ == "__main__":
    main()
