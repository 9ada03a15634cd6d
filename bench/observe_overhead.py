"""What the timeline and the metrics cost a DDP step (not a test).

    python bench/observe_overhead.py [--pairs 150] [--hidden 512] [--depth 4] [--batch-size 64] [--bucket-mb 1]

One 2-rank job (`axond worker --standalone --nproc-per-node 2`) trains the train_mlp model with two DDP
wrappers of the same model over two process groups of the same ranks: one plain (as every group is when
neither AXOND_TIMELINE nor AXOND_METRICS_DIR is set), one whose collectives are timed into the timeline
and the metrics (as every group is when both are set), with the DDP bucket events on. Steps alternate
between the two (A B A B ...), so load on the machine hits both alike. Printed: rank 0's median step
time of each, the median of the per-pair ratios (observed / plain), and the timed events per step.
`--control` times neither (an A/A run). Off, the cost is nil by construction: a plain group runs its class's
methods, with no check per call.
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


def rank_main(args: argparse.Namespace) -> None:
    import axond
    from axond.distributed import new_group
    from axond.examples.train_mlp import TrainConfig, build_model, make_dataset
    from axond.nn import CrossEntropyLoss
    from axond.nn.optim import SGD
    from axond.observe import timeline
    from axond.observe.collectives import wrap_group
    from axond.observe.rank_metrics import RankMetrics
    from axond.parallel import DDP, GradSyncStrategy

    world = axond.init_process_group("tcp")
    plain, observed = new_group(list(range(world.size))), new_group(list(range(world.size)))
    tracer = timeline.Tracer(args.scratch, str(world.rank))
    metrics = RankMetrics(args.scratch, str(world.rank), "bench", "1")
    if not args.control:
        wrap_group(observed, metrics, tracer)
    cfg = TrainConfig(hidden=args.hidden, depth=args.depth, samples=4096)
    x, y, _, _ = make_dataset(cfg)
    runs = []
    for group in (plain, observed):
        model = build_model(cfg)
        ddp = DDP(model, group, bucket_cap_mb=args.bucket_mb, strategy=GradSyncStrategy.OVERLAPPED)
        runs.append((ddp, SGD(list(model.parameters()), lr=1e-4), CrossEntropyLoss()))
    times: list[list[float]] = [[], []]
    for i in range(args.pairs + 10):
        lo = (i * args.batch_size) % (len(x) - args.batch_size)
        for which in ((0, 1) if i % 2 else (1, 0)):  # A B, B A: neither always goes first
            ddp, opt, loss = runs[which]
            timeline.TRACER = tracer if which else None  # DDP's bucket events only for the observed run
            t0 = time.perf_counter()
            opt.zero_grad()
            loss(ddp(x[lo:lo + args.batch_size]), y[lo:lo + args.batch_size])
            ddp.backward(loss.backward())
            opt.step()
            if i >= 10:
                times[which].append(time.perf_counter() - t0)
    timeline.TRACER = None
    tracer.flush()
    events = sum(1 for line in open(tracer.path) if '"ph":"X"' in line)
    if world.rank == 0:
        ratios = [b / a for a, b in zip(*times)]
        print("RESULT " + json.dumps({
            "plain": statistics.median(times[0]), "observed": statistics.median(times[1]),
            "ratio": statistics.median(ratios), "buckets": len(runs[0][0].buckets),
            "events_per_step": events / (args.pairs + 10)}), flush=True)
    axond.destroy_process_group()


def per_event_costs() -> tuple[float, float]:
    """(seconds a timed call adds, seconds serialising one event takes), best of many short runs: the CPU cost
    of the wrappers themselves, away from any transport (quiet moments of a loaded machine show it)."""
    from axond.observe.collectives import wrap_group
    from axond.observe.rank_metrics import RankMetrics
    from axond.observe.timeline import Tracer

    class Group:
        backend, name = object(), "world"

        def all_reduce(self, x: object) -> None:
            return None

    plain, observed = Group(), Group()
    with tempfile.TemporaryDirectory() as scratch:
        tracer, metrics = Tracer(scratch, "0"), RankMetrics(scratch, "0", "bench", "1")
        tracer._stopped.set()
        metrics._stopped.set()
        wrap_group(observed, metrics, tracer)

        def best(group: object, n: int = 2000) -> float:
            fastest = float("inf")
            for _ in range(200):
                t0 = time.perf_counter()
                for _ in range(n):
                    group.all_reduce(plain)  # type: ignore[attr-defined]
                fastest = min(fastest, (time.perf_counter() - t0) / n)
            return fastest

        added = best(observed) - best(plain)
        serialise = float("inf")
        for _ in range(20):
            tracer._events.clear()
            for _ in range(2000):
                tracer.complete("all_reduce", "collective", 1, 1000, 2000, {"group": "world", "bytes": 4096,
                                                                            "path": "mailbox"})
            t0 = time.perf_counter()
            tracer.flush()
            serialise = min(serialise, (time.perf_counter() - t0) / 2000)
        tracer.close()
    return added, serialise


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scratch", default="", help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--control", action="store_true",
                   help="time neither group (an A/A run: the ratio shows what the pairing alone gives)")
    args = p.parse_args()
    if args.rank:
        rank_main(args)
        return
    env = {k: v for k, v in os.environ.items() if k not in ("AXOND_TIMELINE", "AXOND_METRICS_DIR")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="axond-observe-bench-") as scratch:
        cmd = ["axond", "worker", "--standalone", "--nproc-per-node", "2", "--", sys.executable, __file__, "--rank",
               "--scratch", scratch, "--pairs", str(args.pairs), "--hidden", str(args.hidden), "--depth",
               str(args.depth), "--batch-size", str(args.batch_size), "--bucket-mb", str(args.bucket_mb)]
        cmd += ["--control"] if args.control else []
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the job failed ({out.returncode}):\n{out.stderr[-3000:]}")
    r = json.loads(next(line for line in out.stdout.splitlines() if "RESULT " in line).split("RESULT ", 1)[1])
    print(f"2 ranks, train_mlp {args.hidden}x{args.depth}, batch {args.batch_size}, {r['buckets']} DDP buckets of "
          f"{args.bucket_mb:g} MiB per step, {args.pairs} alternating pairs of steps; rank 0")
    print("| DDP step, plain group (ms) | timeline + metrics on (ms) | median pair ratio | events per step |")
    print("|---|---|---|---|")
    print(f"| {r['plain'] * 1e3:.2f} | {r['observed'] * 1e3:.2f} | {r['ratio']:.3f} | {r['events_per_step']:.1f} |")
    added, serialise = per_event_costs()
    per_step = r["events_per_step"] / 2 * (added + serialise) + r["events_per_step"] / 2 * serialise
    print(f"\nper timed call {added * 1e6:.2f} us, per event serialised {serialise * 1e6:.2f} us (best of 200 runs): "
          f"{per_step * 1e6:.0f} us per step, {per_step / r['plain'] * 100:.2f} % of the plain step")


if __name__ == "__main__":
    main()
