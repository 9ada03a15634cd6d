"""What the timeline and the metrics cost a DDP step (not a test).

    python bench/observe_overhead.py [--rounds 5] [--steps 80] [--hidden 512] [--depth 4] [--batch-size 64]

Each round runs one 2-rank job per mode (`axond worker --standalone --nproc-per-node 2`), the modes in turn, so
that load on the machine hits them alike: `off` (nothing set), `timeline` (AXOND_TIMELINE), `metrics`
(AXOND_METRICS_DIR, as a worker with --metrics-port sets it) and `both`. A rank trains the train_mlp model with
DDP (synchronous buckets of 1 MiB, so each step has several all_reduces), times each step after warm-up, and
also times a 4 KiB all_reduce alone (the per-call cost where collectives are smallest). Printed: per mode the
median over rounds of rank 0's median step time, its ratio to `off`, and the small all_reduce's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("off", "timeline", "metrics", "both")


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    import axond
    from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
    from axond.nn import CrossEntropyLoss
    from axond.nn.optim import SGD
    from axond.parallel import DDP, GradSyncStrategy

    group = axond.init_process_group("tcp")
    cfg = TrainConfig(hidden=args.hidden, depth=args.depth, samples=4096)
    x, y, _, _ = make_dataset(cfg)
    model = build_model(cfg)
    ddp = DDP(model, group, bucket_cap_mb=1.0, strategy=GradSyncStrategy.SYNCHRONOUS)
    opt, loss = SGD(list(model.parameters()), lr=1e-4), CrossEntropyLoss()
    times = []
    for i in range(args.steps + 10):
        lo = (i * args.batch_size) % (len(x) - args.batch_size)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss(ddp(x[lo:lo + args.batch_size]), y[lo:lo + args.batch_size])
        ddp.backward(loss.backward())
        opt.step()
        if i >= 10:
            times.append(time.perf_counter() - t0)
    small = np.ones(1024, np.float32)
    calls = []
    for i in range(2000):
        t0 = time.perf_counter()
        axond.all_reduce(small)
        if i >= 200:
            calls.append(time.perf_counter() - t0)
    if group.rank == 0:
        print("RESULT " + json.dumps({"step": statistics.median(times), "small": statistics.median(calls),
                                      "buckets": len(ddp.buckets)}), flush=True)
    axond.destroy_process_group()


def run_mode(mode: str, args: argparse.Namespace, scratch: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("AXOND_TIMELINE", "AXOND_METRICS_DIR")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    if mode in ("timeline", "both"):
        env["AXOND_TIMELINE"] = tempfile.mkdtemp(dir=scratch)
    if mode in ("metrics", "both"):
        env["AXOND_METRICS_DIR"] = tempfile.mkdtemp(dir=scratch)
    cmd = ["axond", "worker", "--standalone", "--nproc-per-node", "2", "--", sys.executable, __file__, "--rank",
           "--steps", str(args.steps), "--hidden", str(args.hidden), "--depth", str(args.depth),
           "--batch-size", str(args.batch_size)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{mode}: the job failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if "RESULT " in l)
    return json.loads(line.split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    if args.rank:
        rank_main(args)
        return
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="axond-observe-bench-") as scratch:
        for r in range(args.rounds):
            for mode in MODES:
                results[mode].append(run_mode(mode, args, scratch))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(x["step"] for x in results["off"])
    buckets = int(results["off"][0]["buckets"])
    print(f"2 ranks, train_mlp {args.hidden}x{args.depth}, batch {args.batch_size}, {buckets} DDP buckets per step, "
          f"{args.rounds} rounds x {args.steps} steps; medians over rounds of rank 0's medians")
    print("| mode | DDP step (ms) | vs off | 4 KiB all_reduce (us) |")
    print("|---|---|---|---|")
    for mode in MODES:
        step = statistics.median(x["step"] for x in results[mode])
        small = statistics.median(x["small"] for x in results[mode])
        print(f"| {mode} | {step * 1e3:.2f} | {step / base:.3f} | {small * 1e6:.1f} |")


if __name__ == "__main__":
    main()
