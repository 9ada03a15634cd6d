"""Interleaved A/B of the collectives of two versions of axond: a git revision against the working tree.

    python bench/compare_trees.py --before REV [--rounds 4] [--busy K] -- --nproc 2 4 --sizes 8 4096 1048576

Each round runs each tree's own `bench/collectives.py` (with the arguments after `--`, peers off) once on REV's
`axond` (a temporary git worktree on PYTHONPATH, its C extensions built in place) and once on this tree's,
alternating which goes first; the table gives, per n, op and size, the median over rounds of each side's median
time per call, and after / before. `--busy K` keeps K busy loops running beside both sides for the whole comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from collectives import start_busy, stop_busy

ROOT = Path(__file__).resolve().parent.parent
Times = dict[str, dict[tuple[str, str, str], list[float]]]


def run(tree: Path, extra: list[str], out: Path) -> dict[str, dict[str, dict[str, list]]]:
    """One run of `tree`'s own bench on `tree`'s axond; its JSON."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "bench" / "collectives.py"), *extra, "--peers", "--no-raw", "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())


def interleave(count: int, old: Path, extra: list[str], tmp: Path, times: Times) -> None:
    """`count` rounds, each running both sides (which goes first alternates); each side's medians into `times`."""
    for r in range(count):
        order = [("before", old), ("after", ROOT)]
        for side, tree in order if r % 2 == 0 else order[::-1]:
            got = run(tree, extra, tmp / f"{side}.json")
            for n, ops in got.items():
                for op, sizes in ops.items():
                    for size, (seconds, ok) in sizes.items():
                        if not ok:
                            sys.exit(f"{side}: {op} at {size} B on {n} ranks gave wrong results")
                        times[side].setdefault((n, op, size), []).append(seconds)
        print(f"round {r + 1} of {count} done", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--busy", type=int, default=0, help="busy loops beside both sides for the whole comparison")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench/collectives.py arguments")
    a = ap.parse_args()
    extra = [x for x in a.rest if x != "--"]
    times: Times = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="axond-ab-") as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), a.before], check=True,
                       capture_output=True, timeout=120)
        try:
            # REV's compiled extensions (the mailbox's `_fastbox`), built in place as `pip install -e .` builds ours
            built = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "build_ext",
                                    "--inplace"], cwd=old, capture_output=True, text=True, timeout=600)
            if built.returncode != 0:
                print(f"{a.before}'s extensions did not build; it runs without them:\n{built.stderr[-2000:]}",
                      file=sys.stderr)
            busy = start_busy(a.busy)
            try:
                interleave(a.rounds, old, extra, Path(tmp), times)
            finally:
                stop_busy(busy)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True,
                           timeout=120)
    load = f", {a.busy} busy loop{'s' if a.busy > 1 else ''} beside both" if a.busy else ""
    print(f"before: {a.before}; after: the working tree; {a.rounds} interleaved rounds{load}: the median and the best "
          "of the rounds' medians (the best is the least disturbed by other load)")
    print("\n| n | op | size (B) | before median / best (us) | after median / best (us) | after / before (median, best) |"
          "\n|---|---|---:|---:|---:|---:|")
    for key in sorted(times["after"], key=lambda k: (int(k[0]), k[1], int(k[2]))):
        b, f = times["before"][key], times["after"][key]
        bm, fm, bb, fb = (statistics.median(b) * 1e6, statistics.median(f) * 1e6, min(b) * 1e6, min(f) * 1e6)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {bm:.1f} / {bb:.1f} | {fm:.1f} / {fb:.1f} | {fm / bm:.2f}, "
              f"{fb / bb:.2f} |")


if __name__ == "__main__":
    main()
