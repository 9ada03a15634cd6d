"""A flapping link between two network-namespace hosts: how soon the data plane resumes once the link is steady.

Two ranks (one per host) all_reduce 256 KiB of float32 in a loop, checking every result exactly, while the switch
drops every frame of host 1 for 2 s, then passes them for 0.2 s, for 30 s (`axond.testing.flap`). Each run reports
the stall after the link is steady (from then to the end of the first step that ends after it) and the longest step,
with the sockets' retransmission timeout capped (AXOND_TCP_RTO_MAX_MS, default 1000) and, with `--kernel-runs`, left
at the kernel's backoff (0) for comparison. Needs root and `ip netns` (docs/design/netns-testing.md).

    python bench/flap.py --runs 5 --kernel-runs 2
"""

from __future__ import annotations

import argparse
import sys

from axond.testing.flap import run_flap
from axond.testing.netns import Network, unavailable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs with the capped retransmission timeout")
    ap.add_argument("--kernel-runs", type=int, default=0, help="runs with the kernel's own backoff, for comparison")
    ap.add_argument("--rto-max-ms", type=int, default=1000, help="AXOND_TCP_RTO_MAX_MS of the capped runs")
    ap.add_argument("--flap", type=float, default=30.0, help="seconds the link flaps")
    ap.add_argument("--drop", type=float, default=2.0, help="seconds of each drop")
    ap.add_argument("--pass", dest="pass_s", type=float, default=0.2, help="seconds the link passes between drops")
    ap.add_argument("--after", type=float, default=5.0, help="seconds the ranks go on once the link is steady")
    ap.add_argument("--timeout", type=float, default=60.0, help="the group timeout")
    ap.add_argument("--congestion", default="system", help="AXOND_TCP_CONGESTION of every run (system: the kernel's)")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        sys.exit(f"bench/flap.py needs network namespaces: {reason}")
    plan = [args.rto_max_ms] * args.runs + [0] * args.kernel_runs
    print(f"flap {args.flap:g} s (drop {args.drop:g} s / pass {args.pass_s:g} s), group timeout {args.timeout:g} s, "
          f"AXOND_TCP_CONGESTION={args.congestion}")
    print("| run | AXOND_TCP_RTO_MAX_MS | steps (all exact) | stall after steady (s) | max step (s) | outcome |")
    print("|---|---|---|---|---|---|")
    with Network.create(2) as net:
        for i, rto in enumerate(plan, 1):
            after = args.after if rto else max(args.after, args.timeout)
            r = run_flap(net, args.flap, args.drop, args.pass_s, after, rto, timeout_s=args.timeout,
                         congestion=args.congestion)
            outcome = "ok" if r.error is None else r.error.strip().splitlines()[-1][:300]
            if r.error is not None:
                print(r.error, file=sys.stderr)
            setting = rto or "0 (kernel)"
            row = f"| {i} | {setting} | {r.ops} | {r.stall_after_steady:.2f} | {r.max_op:.2f} | {outcome} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
