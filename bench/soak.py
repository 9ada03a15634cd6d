"""Chaos soak of live recovery: one random fault every `--period` seconds for `--duration` seconds on a job across
four network-namespace hosts; hangs, hash divergences, recovery times and goodput.

Needs root and `ip netns` (axond/testing/netns.py). A coordinator in host 0 and one `axond worker --live-recovery
--nnodes 2:4 --max-restarts 1000` of one rank in each of hosts 1-4 (bench/soak_train.py: `DistributedTrainer`, ddp,
on four virtual ranks, an MLP of 2.1 MiB, fixed seed). Starting `--period` seconds after the job first trained at full
size, a seeded random fault strikes a random host every `--period` seconds:

- kill: its rank SIGKILLed;
- stop: its rank SIGSTOPped for `--hold` seconds (its worker kills it once it has been stopped for the lease);
- drop: every frame to and from the host dropped for `--hold` seconds, both ways (its worker loses its lease and stops
  its rank; the link back, it re-joins).

A failed node's own worker re-joins the running job as a replacement (one restart counted each time), and its new
rank takes the state from a live peer, so the job returns to four ranks after each fault. After the last fault the
job ends at one step on every rank, and every step's parameters are compared with a fault-free replay of the same
virtual ranks in one process.

    python bench/soak.py --duration 600                      # the 10-minute soak (about 14 minutes in all)
    python bench/soak.py --duration 90 --faults kill,drop    # shorter
    python bench/soak.py --torch --duration 600              # torch DDP over "axond" (bench/soak_train_torch.py)
    # the job shrinking (an 18 MiB model), the failed node's worker started again 10 s later:
    python bench/soak.py --duration 45 --faults kill --hidden 1536 --parallel zero --max-restarts 0 --respawn-after 10

`--torch` runs torch DDP over "axond" through `axond.torch.live.Manager` on the same MLP and faults; torch's DDP sums
the gradients in its own order, so each step's loss and the final loss are compared with a fault-free run's (within
1e-5 relative) instead of the parameters' hashes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from axond.testing.netns import unavailable
from soak_report import SoakReport, analyse, table
from soak_run import SoakConfig, SoakRun, load, run_soak

KINDS = ("kill", "stop", "drop")


def show(report: SoakReport, run: SoakRun) -> None:
    print(table(report, run))
    for step, gap in report.hangs:
        print(f"hang: no committed step for {gap:.2f} s before step {step}")
    for step, gap in report.join_waits:
        print(f"join: no committed step for {gap:.2f} s before step {step}, while a joining rank's process started")
    for pid, step, got, want in report.divergences[:10]:
        print(f"divergence: pid {pid} step {step}: {got} (fault-free {want})")
    if run.config.torch and not report.final_losses:
        print("no rank wrote its final loss at the last step")
    for line in report.order_errors:
        print(f"order: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    parser.add_argument("--period", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--faults", default=",".join(KINDS), help=f"which of {', '.join(KINDS)} (comma-separated)")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds a SIGSTOP or a DROP lasts")
    parser.add_argument("--heartbeat", type=float, default=0.25, help="the coordinator's heartbeat interval (s)")
    parser.add_argument("--missed", type=int, default=6, help="the coordinator's --dead-after-missed")
    parser.add_argument("--min-nodes", type=int, default=2, help="MIN of --nnodes MIN:4")
    parser.add_argument("--max-restarts", type=int, default=1000,
                        help="the workers' --max-restarts (0: a failed node's worker exits and the job re-forms "
                             "without waiting for it; the soak then starts a new worker in that host, which joins)")
    parser.add_argument("--respawn-after", type=float, default=0.0,
                        help="seconds after a worker exited before the soak starts it again (the job runs smaller)")
    parser.add_argument("--copy-every", type=int, default=1,
                        help="ZeRO-1/FSDP: the trainer's copy_every (both copies every N steps)")
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width (512: 2.1 MiB of parameters)")
    parser.add_argument("--parallel", choices=("ddp", "zero", "fsdp"), default="ddp",
                        help="the trainer's parallel mode (zero: ZeRO-1, fsdp: FSDP, both on the virtual ranks)")
    parser.add_argument("--torch", action="store_true",
                        help="torch DDP over \"axond\" (axond.torch.live.Manager) instead of DistributedTrainer: "
                             "the loss is compared with a fault-free run's (within 1e-5 relative), not the hashes")
    parser.add_argument("--out", default="", help="keep the logs in this directory (default: a temporary one)")
    parser.add_argument("--analyse", default="", help="only analyse the run kept in this directory (by --out)")
    args = parser.parse_args()
    if args.analyse:
        run = load(Path(args.analyse))
        show(analyse(run), run)
        return
    faults = tuple(args.faults.split(","))
    if not set(faults) <= set(KINDS):
        parser.error(f"--faults takes {', '.join(KINDS)} (comma-separated), got {args.faults!r}")
    reason = unavailable()
    if reason:
        raise SystemExit(f"the soak needs network namespaces: {reason}")
    config = SoakConfig(duration=args.duration, period=args.period, faults=faults, seed=args.seed, hold=args.hold,
                        heartbeat=args.heartbeat, missed=args.missed, min_nodes=args.min_nodes, hidden=args.hidden,
                        max_restarts=args.max_restarts, respawn_after=args.respawn_after,
                        parallel=args.parallel, torch=args.torch, copy_every=args.copy_every)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="axond-soak-"))
    began = time.monotonic()
    try:
        run = run_soak(config, out)
        print(f"[soak] job ended after {run.ended - run.started:.0f} s; replaying {run.stop_step} steps without "
              "faults", flush=True)
        show(analyse(run), run)
        print(f"[soak] {time.monotonic() - began:.0f} s in all; logs in {out}")
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
