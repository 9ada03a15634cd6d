"""From a SIGKILLed rank to the survivors computing again: live recovery against today's restart path.

One run: an in-process coordinator (heartbeat interval `--heartbeat` s), three `axond worker` nodes of one rank each
on this host, `DistributedTrainer` (ddp) on a small MLP (tests/helpers/live_train.py, 60 steps); the rank that
starts as rank 2 stops after step 20 and is SIGKILLed there, while the others wait in step 21.

- live: `axond worker --nnodes 2:3 --live-recovery`, no checkpoint directory; the survivors re-form at world size 2.
- restart: `axond worker --nnodes 3 --max-restarts 1`, a checkpoint after every step (so that the restart loses no
  step); every rank is stopped, started again, re-imports, re-forms and loads the last checkpoint.

Columns (seconds from the kill, time.monotonic() of this host): the last survivor's `MembershipChanged` (live only),
the last survivor's group re-formed and agreed on the step (live only), and the first step after the cut one
completed, on any rank.

    python bench/recovery.py --runs 3
    python bench/recovery.py --runs 3 --parallel zero   # ZeRO-1: the lost rank's shard from its buddy's copy
    python bench/recovery.py --runs 3 --parallel fsdp   # FSDP on virtual ranks: the same, parameters sharded too
    python bench/recovery.py --part step-cost --world 3 --hidden 512   # what the virtual-rank step costs
    python bench/recovery.py --part step-cost --world 3 --hidden 1024 --steps 15 --loops zero,fsdp --rounds 2
    python bench/recovery.py --part cut --runs 3 --heartbeat 0.25 --missed 6   # root: netns hosts, faults by the lease

`--part cut` (root and `ip netns`): a coordinator and four worker hosts in network namespaces (axond/testing/netns.py),
one rank each, live recovery, lease `--heartbeat` x `--missed`, `--fence-margin 0.5`; rank 2's host is lost three
ways while the others wait in step 21: its rank SIGKILLed (for comparison), its link dropping every frame both ways
(`Host.drop_frames`: no FIN or reset reaches the survivors), or its worker daemon stopped (SIGSTOP). Same columns,
from the fault.

`--part step-cost`: the median step time of `DistributedTrainer` in `--world` processes on loopback (an MLP of
`--hidden` units, 4 layers): plain DDP (bucketed all_reduce), virtual ranks deterministic (one all_gather of every
virtual rank's gradient, summed in order), virtual ranks fast (each rank's sum all_reduced), and ZeRO-1 and FSDP on
virtual ranks (no buddy copies: FSDP reduce-scatters the rows in virtual-rank order, an all_to_all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from axond import nn
from axond.coordinator.server import CoordinatorConfig, start_coordinator
from axond.distributed import default_group
from axond.nn.optim import AdamW
from axond.fencing import fence_wait
from axond.testing import run_processes
from axond.testing.netns import Network, unavailable
from axond.train import Callback, DistributedTrainer

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "live_train.py"
HANG_STEP = 20
TOKEN = "bench-cut-token"
"""The coordinator's token in `--part cut` (its hosts are namespaces of this machine)."""


def _workers(address: str, job: str, out: Path, live: bool, rejoin: bool = False) -> list[subprocess.Popen[str]]:
    """`rejoin`: live workers with `--max-restarts 1` (the failed node's worker re-joins the running job)."""
    shape = ["--nnodes", "2:3", "--live-recovery", "--max-restarts", str(int(rejoin))] if live else [
        "--nnodes", "3", "--max-restarts", "1"]
    rank = [sys.executable, str(SCRIPT), str(out), str(HANG_STEP)] + ([] if live else [str(out / "ckpt")])
    argv = [sys.executable, "-c", "from axond.cli.main import main; main()", "worker", "--coordinator", address,
            "--job", job, *shape, "--join-timeout", "120", "--", *rank]
    return [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for _ in range(3)]


def _steps(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for p in out.glob("steps-*.jsonl") for line in p.read_text().splitlines()]


def _hung_pid(out: Path, timeout: float = 180.0) -> int:
    """The pid of rank 2 once it stopped after its step (it writes `hang-PID` in `out`)."""
    deadline = time.monotonic() + timeout
    while not any(out.glob("hang-*")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 2 did not reach its step within {timeout:.0f} s")
        time.sleep(0.02)
    return int(next(out.glob("hang-*")).name.removeprefix("hang-"))


def one_run(address: str, live: bool, job: str, rejoin: bool = False, stop_s: float = 0.0,
            extra: Callable[[Path, float], dict[str, float]] | None = None) -> dict[str, float]:
    """Seconds from the kill to each milestone (NaN where the path has none), and the bytes read from storage.
    `stop_s` > 0: rank 2 is stopped (SIGSTOP) for that long instead of killed; `extra(out, fault_time)` adds its
    figures from the run's records (bench/torchft_compare.py)."""
    out = Path(tempfile.mkdtemp(prefix="axond-recovery-"))
    workers = _workers(address, job, out, live, rejoin)
    try:
        pid = _hung_pid(out)
        killed = time.monotonic()
        os.kill(pid, signal.SIGSTOP if stop_s else signal.SIGKILL)
        if stop_s:  # once resumed it goes on with its step (the go file ends its wait)
            (out / "go").write_text("")
            threading.Timer(stop_s, _resume, (pid,)).start()
        codes = []
        for w in workers:
            _, err = w.communicate(timeout=180)
            codes.append(w.returncode)
            if w.returncode != 0 and live and "goes on without this node" not in err:
                raise RuntimeError(f"worker exited {w.returncode}: {err[-2000:]}")
        ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
        after = [s["mono"] for s in _steps(out) if s["step"] > HANG_STEP and s["mono"] > killed]
        recoveries = [r for e in ends for r in e["recoveries"]]
        stored = sum(f.stat().st_size for f in (out / "ckpt").rglob("*") if f.is_file()) if not live else 0
        nan = float("nan")
        return {
            "error": max(r["error_at"] for r in recoveries) - killed if recoveries else nan,
            "reformed": max(r["reformed_at"] for r in recoveries) - killed if recoveries else nan,
            "first_step": min(after) - killed,
            "exit_codes": float(sorted(codes) == ([0, 0, 1] if live and not rejoin else [0, 0, 0])),
            "checkpoint_bytes": float(stored // max(1, len(list((out / "ckpt").glob("step_*")))) if not live else 0.0),
            **(extra(out, killed) if extra is not None else {}),
        }
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        shutil.rmtree(out, ignore_errors=True)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # its worker killed it (stopped for longer than the lease)


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = time.perf_counter()

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


@dataclass(frozen=True)
class _StepCost:
    """Picklable per-rank entry point for run_processes (the children import this module)."""

    hidden: int
    steps: int
    options: tuple[tuple[str, Any], ...]

    def __call__(self) -> float:
        group = default_group()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.steps * 8 * 4, self.hidden)).astype(np.float32)
        y = rng.integers(0, 10, len(x))
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(self.hidden, self.hidden, rng=rng), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(self.hidden, 10, rng=rng))
        times = _StepTimes()
        trainer = DistributedTrainer(model, lambda p: AdamW(p, lr=1e-3), nn.CrossEntropyLoss(), (x, y),
                                     batch_size=8, group=group, progress=False, shuffle=False, callbacks=[times],
                                     **dict(self.options))
        times.last = time.perf_counter()
        trainer.fit(1)
        return float(statistics.median(times.times[3:]))


STEP_LOOPS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "ddp": ("DDP (parallel='ddp')", ()),
    "deterministic": ("virtual ranks, deterministic", (("virtual_ranks", 0),)),
    "fast": ("virtual ranks, fast", (("virtual_ranks", 0), ("deterministic", False))),
    "zero": ("ZeRO-1 on virtual ranks", (("virtual_ranks", 0), ("parallel", "zero"), ("copy_every", None))),
    "fsdp": ("FSDP on virtual ranks", (("virtual_ranks", 0), ("parallel", "fsdp"), ("copy_every", None))),
}
"""--part step-cost's loops (virtual_ranks 0: the world size)."""


def step_cost(world: int, hidden: int, steps: int, loops: list[str], rounds: int = 1) -> None:
    params = 3 * (hidden * hidden + hidden) + hidden * 10 + 10
    print(f"{world} ranks on loopback, MLP of {params:,} float32 parameters ({params * 4 / 2**20:.1f} MiB), "
          f"batch 8 per virtual rank; median step of {steps} (the first 3 left out); {rounds} round(s), interleaved")
    print("| loop | median step (ms) | vs the first loop |")
    print("|---|---:|---:|")
    base = 0.0
    for _ in range(rounds):
        for key in loops:
            name, options = STEP_LOOPS[key]
            options = tuple((k, world if k == "virtual_ranks" else v) for k, v in options)
            median = statistics.median(run_processes(_StepCost(hidden, steps, options), world, timeout=600))
            base = base or median
            print(f"| {name} | {median * 1e3:.1f} | {median / base:.2f}x |", flush=True)


def _axond(*args: str) -> list[str]:
    return [sys.executable, "-c", "from axond.cli.main import main; main()", *args]


def cut_run(fault: str, heartbeat: float, missed: int, rejoin: bool = False, fault_s: float = 0.0,
            extra: Callable[[Path, float], dict[str, float]] | None = None) -> dict[str, float]:
    """One live job across four namespace hosts; rank 2's host lost by `fault` (kill, drop, stop-worker, or stop:
    the rank SIGSTOPped): seconds from the fault to the survivors' error, to the re-formed group and to the first
    step after the cut one. `rejoin`: workers with `--max-restarts 1`; `fault_s` > 0: a drop or stop ends after that
    long; `extra(out, fault_time)` adds its figures from the run's records (bench/torchft_compare.py)."""
    out = Path(tempfile.mkdtemp(prefix="axond-cut-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stopped: list[int] = []
    timers: list[threading.Timer] = []
    with Network.create(5) as net:
        h0, *hosts = net.hosts
        try:
            h0.popen(_axond("coordinator", "--host", h0.addr, "--port", "29500", "--token", TOKEN, "--in-memory",
                            "--heartbeat-interval", str(heartbeat), "--dead-after-missed", str(missed),
                            "--settle-time", "10", "--fence-margin", "0.5"),
                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            argv = _axond("worker", "--coordinator", f"{h0.addr}:29500", "--token", TOKEN, "--nnodes", "3:4",
                          "--job", "cut", "--live-recovery", "--join-timeout", "60", "--max-restarts", str(int(rejoin)),
                          "--", sys.executable, str(SCRIPT), str(out), str(HANG_STEP))
            workers = {h.index: h.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                       for h in hosts}
            pid = _hung_pid(out)
            (host,) = [h for h in hosts if pid in h.pids()]
            if fault == "kill":
                at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
            elif fault == "drop":
                host.drop_frames(True)
                at = time.monotonic()
                if fault_s:  # the rank goes on (the go file ends its wait): its link is what failed
                    (out / "go").write_text("")
                    timers.append(threading.Timer(fault_s, host.drop_frames, (False,)))
            else:
                stopped.append(pid if fault == "stop" else workers[host.index].pid)
                os.kill(stopped[0], signal.SIGSTOP)
                at = time.monotonic()
                if fault_s:
                    (out / "go").write_text("")
                    timers.append(threading.Timer(fault_s, _resume, (stopped.pop(),)))
            for timer in timers:
                timer.start()
            for index, w in workers.items():
                if index != host.index:
                    _, err = w.communicate(timeout=180)
                    if w.returncode != 0:
                        raise RuntimeError(f"a survivor's worker exited {w.returncode}: {err[-2000:]}")
            ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
            recoveries = [r for e in ends for r in e["recoveries"]]
            after = [s["mono"] for s in _steps(out) if s["step"] > HANG_STEP and s["mono"] > at]
            return {"error": max(r["error_at"] for r in recoveries) - at,
                    "reformed": max(r["reformed_at"] for r in recoveries) - at, "first_step": min(after) - at,
                    **(extra(out, at) if extra is not None else {})}
        finally:
            for timer in timers:
                timer.cancel()
            for p in stopped:
                _resume(p)
            shutil.rmtree(out, ignore_errors=True)


FAULTS = {"kill": "rank SIGKILLed", "drop": "link DROP both ways", "stop-worker": "worker daemon SIGSTOPped"}


def cut(runs: int, heartbeat: float, missed: int, faults: list[str]) -> None:
    reason = unavailable()
    if reason:
        raise SystemExit(f"--part cut needs network namespaces: {reason}")
    lease = heartbeat * missed
    print(f"4 namespace hosts on one machine, one rank each; lease {heartbeat} s x {missed} = {lease:g} s, fence "
          f"wait {fence_wait(lease, heartbeat, 0.5):.2f} s; seconds from the fault, median (min-max) of {runs} runs")
    print("| fault on rank 2's host | survivors' error | re-formed | first step after the fault |")
    print("|---|---:|---:|---:|")
    for fault in faults:
        name = FAULTS[fault]
        results = [cut_run(fault, heartbeat, missed) for _ in range(runs)]
        print(f"| {name} | {cell([r['error'] for r in results])} | {cell([r['reformed'] for r in results])} | "
              f"{cell([r['first_step'] for r in results])} |", flush=True)


def cell(values: list[float]) -> str:
    """A table cell: the median and (min-max) of `values`, NaNs left out; "-" when none is left."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="the coordinator's heartbeat interval (s)")
    parser.add_argument("--part", choices=("recovery", "step-cost", "cut"), default="recovery")
    parser.add_argument("--missed", type=int, default=6, help="--part cut: the coordinator's --dead-after-missed")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"--part cut: which of {', '.join(FAULTS)}")
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loops", default="ddp,deterministic,fast,zero,fsdp",
                        help=f"--part step-cost: which of {', '.join(STEP_LOOPS)} (comma-separated)")
    parser.add_argument("--rounds", type=int, default=1, help="--part step-cost: run the loops this many times in turn")
    parser.add_argument("--parallel", choices=("ddp", "zero", "fsdp"), default="ddp",
                        help="the trainer's parallel mode in the recovery runs (zero: ZeRO-1, fsdp: FSDP, both on the "
                        "virtual ranks with buddy copies)")
    args = parser.parse_args()
    os.environ["LIVE_TEST_PARALLEL"] = args.parallel  # read by tests/helpers/live_train.py in the workers' ranks
    if args.part == "step-cost":
        loops = args.loops.split(",")
        if not set(loops) <= set(STEP_LOOPS):
            parser.error(f"--loops takes {', '.join(STEP_LOOPS)} (comma-separated), got {args.loops!r}")
        step_cost(args.world, args.hidden, args.steps, loops, args.rounds)
        return
    if args.part == "cut":
        faults = args.faults.split(",")
        if not set(faults) <= set(FAULTS):
            parser.error(f"--faults takes {', '.join(FAULTS)} (comma-separated), got {args.faults!r}")
        cut(args.runs, args.heartbeat, args.missed, faults)
        return
    coord = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True, insecure=True,
                                                heartbeat_interval=args.heartbeat, dead_after_missed=5,
                                                settle_time=5.0))
    print(f"heartbeat interval {args.heartbeat} s; seconds from the SIGKILL, median (min-max) of {args.runs} runs")
    print("| path | survivors' error | re-formed | first step after the kill | exit codes as expected | "
          "bytes read from storage |")
    print("|---|---:|---:|---:|---|---:|")
    try:
        for live in (True, False):
            runs = [one_run(coord.address, live, f"recovery-{live}-{i}") for i in range(args.runs)]
            ok = sum(int(r["exit_codes"]) for r in runs)
            stored = int(runs[0]["checkpoint_bytes"])
            print(f"| {'live (--live-recovery)' if live else 'restart (--max-restarts 1)'} | "
                  f"{cell([r['error'] for r in runs])} | {cell([r['reformed'] for r in runs])} | "
                  f"{cell([r['first_step'] for r in runs])} | {ok} of {args.runs} | "
                  f"{'0' if live else f'a checkpoint of {stored:,}'} |", flush=True)
    finally:
        coord.stop(grace=0.2)


if __name__ == "__main__":
    main()
