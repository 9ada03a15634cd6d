"""torch DDP over "axond" through a SIGKILLed rank: `axond.torch.live.Manager` under `axond worker --live-recovery`.

One run: an in-process coordinator (heartbeat interval `--heartbeat` s), three `axond worker --nnodes 2:3
--live-recovery` nodes of one rank each on this host, tests/helpers/live_torch_ddp.py (an MLP on 3 virtual ranks, 40
steps); the rank that starts as rank 2 stops after committing step 15 and is SIGKILLed there, while the others wait in
step 16's gradient all-reduce. Columns (seconds from the kill, time.monotonic() of this host): the last survivor's
caught failure, the last survivor's torch group re-formed, agreed and DDP rebuilt (computing again), the first step
after the kill committed; then the final loss's relative difference to a run without the failure (three workers, no
kill), and whether the parameters equal the fault-free run's bit for bit. The same kill on today's restart path
(`--nnodes 3 --max-restarts 1`, rank 0 saving the manager's state after every step, every rank loading it at start)
for comparison.

    python bench/torch_live.py --runs 5
    python bench/torch_live.py --runs 5 --wrap fsdp2   # FSDP2 through ShardedManager (its state from full copies)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from axond.coordinator.server import CoordinatorConfig, start_coordinator
from recovery import cell

HELPERS = Path(__file__).resolve().parents[1] / "tests" / "helpers"
SCRIPT = HELPERS / "live_torch_ddp.py"
HANG_STEP = 15


def one_run(address: str, job: str, kill: bool, live: bool = True) -> dict[str, Any]:
    """Seconds from the kill to each milestone and the survivors' final loss (the run's, without `kill`)."""
    out = Path(tempfile.mkdtemp(prefix="axond-torch-live-"))
    shape = ["--nnodes", "2:3", "--live-recovery"] if live else ["--nnodes", "3", "--max-restarts", "1"]
    argv = [sys.executable, "-c", "from axond.cli.main import main; main()", "worker", "--coordinator", address,
            "--job", job, *shape, "--join-timeout", "120", "--",
            sys.executable, str(SCRIPT), str(out), str(HANG_STEP if kill else -1)]
    env = dict(os.environ, LIVE_TORCH_CHECKPOINT=str(out)) if not live else None
    workers = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True) for _ in range(3)]
    try:
        killed = 0.0
        if kill:
            deadline = time.monotonic() + 180
            while not any(out.glob("hang-*")):
                if time.monotonic() > deadline:
                    raise RuntimeError("rank 2 did not reach its step within 180 s")
                time.sleep(0.02)
            killed = time.monotonic()
            os.kill(int(next(out.glob("hang-*")).name.split("-")[-1]), signal.SIGKILL)
        codes = []
        for w in workers:
            _, err = w.communicate(timeout=180)
            codes.append(w.returncode)
            if w.returncode != 0 and (not live or "goes on without this node" not in err):
                raise RuntimeError(f"worker exited {w.returncode}: {err[-2000:]}")
        ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
        recoveries = [r for e in ends for r in e["recoveries"]]
        after = [json.loads(line)["mono"] for p in out.glob("steps-*.jsonl") for line in p.read_text().splitlines()
                 if json.loads(line)["step"] > HANG_STEP and json.loads(line)["mono"] > killed]
        losses = {e["final_loss"] for e in ends}
        digests = {e["params"] for e in ends}
        if len(losses) != 1:
            raise RuntimeError(f"the survivors ended with different losses: {losses}")
        nan = float("nan")
        return {"error": max(r["error_at"] for r in recoveries) - killed if recoveries else nan,
                "reformed": max(r["reformed_at"] for r in recoveries) - killed if recoveries else nan,
                "first_step": min(after) - killed if kill else nan, "loss": losses.pop(),
                "params": digests.pop() if len(digests) == 1 else "differ",
                "ok": float(sorted(codes) == ([0, 0, 1] if kill and live else [0, 0, 0]))}
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="the coordinator's heartbeat interval (s)")
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp",
                        help="DDP (Manager) or FSDP2 (ShardedManager; the live path only)")
    args = parser.parse_args()
    os.environ["LIVE_TORCH_WRAP"] = args.wrap  # read by tests/helpers/live_torch_ddp.py in the workers' ranks
    sys.path.insert(0, str(HELPERS))
    from live_torch_ddp import reference

    coord = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True, insecure=True,
                                                heartbeat_interval=args.heartbeat, dead_after_missed=5,
                                                settle_time=5.0))
    try:
        fault_free = one_run(coord.address, "torch-live-clean", kill=False)
        paths = {live: [one_run(coord.address, f"torch-{live}-{i}", kill=True, live=live) for i in range(args.runs)]
                 for live in ((True, False) if args.wrap == "ddp" else (True,))}
    finally:
        coord.stop(grace=0.2)
    clean, alone = fault_free["loss"], reference()
    print(f"{args.wrap}; heartbeat interval {args.heartbeat} s; seconds from the SIGKILL, median (min-max) of "
          f"{args.runs} runs")
    print("| path | survivors' error | computing again (re-formed, DDP rebuilt) | first step after committed | "
          "exit codes as expected | loss vs fault-free run (max rel.) | parameters = fault-free run's |")
    print("|---|---:|---:|---:|---|---:|---|")
    for live, runs in paths.items():
        same = sum(r["params"] == fault_free["params"] for r in runs)
        print(f"| {'live (--live-recovery)' if live else 'restart (--max-restarts 1, a checkpoint every step)'} | "
              f"{cell([r['error'] for r in runs])} | {cell([r['reformed'] for r in runs])} | "
              f"{cell([r['first_step'] for r in runs])} | {sum(int(r['ok']) for r in runs)} of {args.runs} | "
              f"{max(abs(r['loss'] - clean) / clean for r in runs):.1e} | {same} of {args.runs} bit for bit |")
    print(f"fault-free final loss {clean!r}; the same training in one process {alone!r} "
          f"({abs(alone - clean) / clean:.1e} relative)")


if __name__ == "__main__":
    main()
