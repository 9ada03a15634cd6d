"""The mpi backend beside raw mpi4py, repeated: medians over rounds of bench/collectives.py (docs/mpi.md).

    python bench/mpi_speed.py --rounds 5 --nproc 2 --sizes 8 65536 1048576 16777216 67108864 [--before DIR]

Each round runs `bench/collectives.py --backend mpi --peers mpi --no-raw --mpi-btl vader,self` once: per op, axond's
mpi backend, then raw mpi4py's blocking calls, each under its own `mpirun`, so that axond and raw MPI alternate
within a round and a busy stretch of a shared machine falls on both. `--before DIR` also runs, first in each round,
the `axond` package found in DIR (another version, e.g. `git archive main axond | tar -x -C DIR`), for a before and
after in the same rounds. Printed: per op and size, the median over rounds of each time, of each round's ratio
raw / axond (1.00x: the same time), and of the time axond adds per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
Row = tuple[str, str]
"""(op, size as collectives.py prints it)."""


def one_run(args: argparse.Namespace, path: str | None) -> dict[Row, tuple[float, float]]:
    """One collectives.py run: (op, size) -> (axond us, raw mpi4py us); `path` goes first on PYTHONPATH."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(HERE / "collectives.py"), "--backend", "mpi", "--peers", "mpi", "--no-raw",
           "--mpi-btl", args.mpi_btl, "--nproc", str(args.nproc), "--ops", *args.ops,
           "--sizes", *[str(s) for s in args.sizes]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    got: dict[Row, tuple[float, float]] = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 9 and cells[2].endswith(" us") and cells[6].endswith(" us"):
            if cells[5] != "yes":
                sys.exit(f"wrong result: {line}")
            got[(cells[0], cells[1])] = (float(cells[2][:-3]), float(cells[6][:-3]))
    if not got:
        sys.exit(f"no table in the output of {' '.join(cmd)}:\n{out.stdout[-2000:]}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 65536, 1048576, 16777216, 67108864])
    ap.add_argument("--ops", nargs="+", default=["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
    ap.add_argument("--mpi-btl", default="vader,self")
    ap.add_argument("--before", help="a folder holding another version's `axond` package, run first in each round")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    sides = {"axond": None} if args.before is None else {"before": args.before, "axond": None}
    runs: dict[str, list[dict[Row, tuple[float, float]]]] = {k: [] for k in sides}
    for i in range(args.rounds):
        for name, path in sides.items():
            runs[name].append(one_run(args, path))
        print(f"round {i + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    rows = list(runs["axond"][0])
    names = list(sides)
    print(f"{args.nproc} ranks, --mca btl {args.mpi_btl}, median of {args.rounds} rounds (each: axond"
          f"{' before, axond after' if args.before else ''} and raw mpi4py per op)\n")
    head = "| op | size | raw mpi4py |" + "".join(f" {k} | raw / {k} | {k} adds |" for k in names)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        raw = [r[row][1] for k in names for r in runs[k]]
        line = f"| {row[0]} | {row[1]} | {statistics.median(raw):.1f} us |"
        for k in names:
            ours = [r[row][0] for r in runs[k]]
            ratio = [r[row][1] / r[row][0] for r in runs[k]]
            added = [r[row][0] - r[row][1] for r in runs[k]]
            line += (f" {statistics.median(ours):.1f} us | {statistics.median(ratio):.2f}x "
                     f"({min(ratio):.2f}-{max(ratio):.2f}) | {statistics.median(added):+.1f} us |")
        print(line)


if __name__ == "__main__":
    main()
