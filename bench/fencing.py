"""Fencing under every partition shape: how long before the next generation starts the cut-off one is dead.

Runs each shape of tests/helpers/fencing_run.py N times (network-namespace hosts, iptables; root) and prints a
table: shape, runs, overlaps (runs where a rank of the old generation was alive after the new one started), and
the min and median margin (the new generation's first start minus the last sign of life of any rank of the old
one, seconds), and the median of the same from the cut-off host's rank alone.

    python bench/fencing.py --runs 5 --shapes reject-icmp,reject-tcp-reset
    python bench/fencing.py --runs 2            # every shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers"))
from fencing_run import HEARTBEAT, LEASE, SHAPES, run_shape, unavailable

from axond.fencing import FENCE_MARGIN_S, fence_wait
from axond.testing.netns import Network
from axond.testing.netns import unavailable as netns_unavailable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    reason = netns_unavailable() or unavailable()
    if unknown or reason:
        print(f"cannot run: {reason or f'unknown shapes {unknown}'}", file=sys.stderr)
        return 2
    print(f"lease {LEASE:g} s, fence margin {FENCE_MARGIN_S:g} s (the coordinator waits "
          f"{fence_wait(LEASE, HEARTBEAT, FENCE_MARGIN_S):.2f} s after declaring a node dead)")
    rows = []
    for shape in shapes:
        margins, cut_margins, overlaps, fenced = [], [], 0, 0
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="axond-fencing-") as tmp, Network.create(3) as net:
                out = run_shape(net, shape, Path(tmp) / "run")
            margins.append(out.margin)
            cut_margins.append(out.cut_margin)
            overlaps += out.overlap
            fenced += out.cut_code == 3
            print(f"  {shape} run {i + 1}: margin {out.margin:+.3f} s (cut-off host {out.cut_margin:+.3f} s), "
                  f"cut-off worker exit {out.cut_code}", flush=True)
        rows.append((shape, args.runs, overlaps, fenced, min(margins), statistics.median(margins),
                     min(cut_margins), statistics.median(cut_margins)))
    print("\n| shape | runs | overlaps | cut-off worker exit 3 | min margin (s) | median margin (s) "
          "| min / median margin of the cut-off host (s) |")
    print("|---|---|---|---|---|---|---|")
    for shape, runs, overlaps, fenced, lo, med, cut_lo, cut_med in rows:
        print(f"| {shape} | {runs} | {overlaps} | {fenced} | {lo:.3f} | {med:.3f} | {cut_lo:.3f} / {cut_med:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
