"""How often the worker's last line names a SIGKILLed rank and its signal (not the survivors it took down).

One run: an in-process coordinator, one or two `axond worker` processes (2 ranks in all), a training loop (native
all_reduce, or torch DDP over the "axond" backend), one rank SIGKILLed mid-loop (the rank alternates between runs).
A run counts when every worker's last stderr line names the killed rank and `137 (SIGKILL)`, and no other rank as
the failure.

    python bench/kill_blame.py --runs 10                  # native and torch, one node and two nodes
    python bench/kill_blame.py --runs 3 --mode torch-1node
    python bench/kill_blame.py --runs 10 --mode torchrun   # torchrun's "Root Cause" instead of a worker's line
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers"))
from kill_programs import NATIVE, TORCH  # the killed-rank tests' programs

from axond.coordinator.server import CoordinatorConfig, start_coordinator

MODES = {"native-1node": (NATIVE, 1), "torch-1node": (TORCH, 1), "native-2nodes": (NATIVE, 2),
         "torch-2nodes": (TORCH, 2), "torchrun": (TORCH, 1)}
"""mode -> (rank program, nodes); "torchrun" runs it under `python -m torch.distributed.run` and reads its root
cause instead of a worker's last line."""


def axond_argv() -> list[str]:
    return [sys.executable, "-c", "from axond.cli.main import main; main()"]


def _launchers(mode: str, address: str, job: str, script: Path, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    nodes = MODES[mode][1]
    if mode == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
        env = {k: v for k, v in env.items() if not k.startswith(("AXOND_", "TORCHELASTIC_"))}
    else:
        argv = [*axond_argv(), "worker", "--coordinator", address, "--job", job, "--nnodes", str(nodes),
                "--nproc-per-node", str(2 // nodes), "--", sys.executable, str(script)]
    return [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for _ in range(nodes)]


def _torchrun_root_cause(stderr: str) -> str:
    """torchrun's "Root Cause" section as one line: `rank 1 ... exitcode -9 ... (SIGKILL)`."""
    section = stderr.split("Root Cause (first observed failure):", 1)[-1].split("=====", 1)[0]
    rank = re.search(r"rank\s+: (\d+)", section)
    code = re.search(r"exitcode\s+: (-?\d+).*?(\(SIG\w+\))?$", section, re.M)
    if rank is None or code is None:
        return ""
    signal_name = code.group(2) or ""
    return f"rank {rank.group(1)} exited with code {code.group(1)} {signal_name}".strip()


def one_run(address: str, mode: str, victim: int, job: str) -> tuple[bool, list[str]]:
    """Run one job of `mode`, SIGKILL rank `victim`; (whether every worker's last line, or torchrun's root cause,
    blames it, those lines)."""
    source = MODES[mode][0]
    with tempfile.TemporaryDirectory(prefix="axond-kill-") as tmp:
        script = Path(tmp, "train.py")
        script.write_text(source)
        workers = _launchers(mode, address, job, script, dict(os.environ, PID_DIR=tmp))
        try:
            pid_file = Path(tmp, f"pid{victim}")
            deadline = time.monotonic() + 120
            while not (pid_file.exists() and Path(tmp, f"pid{1 - victim}").exists()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: the ranks did not start within 120 s")
                time.sleep(0.1)
            time.sleep(0.5)
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            lines = []
            for w in workers:
                _, err = w.communicate(timeout=120)
                if mode == "torchrun":
                    lines.append(_torchrun_root_cause(err))
                else:
                    lines.append(err.strip().splitlines()[-1] if err.strip() else "")
        finally:
            for w in workers:
                if w.poll() is None:
                    os.killpg(w.pid, signal.SIGKILL)
                    w.wait()
    other = f"rank {1 - victim} "
    signalled = ("137 (SIGKILL)", "-9 (SIGKILL)")
    ok = all(f"rank {victim} " in line and any(s in line for s in signalled) and other not in line.split(" (then ")[0]
             for line in lines)
    return ok, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--mode", choices=sorted(MODES), action="append")
    args = parser.parse_args()
    coord = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True, insecure=True,
                                                heartbeat_interval=0.2, dead_after_missed=15, settle_time=0.2))
    print("| mode | runs | last line names the killed rank and SIGKILL |")
    print("|---|---|---|")
    try:
        for mode in args.mode or list(MODES):
            named = 0
            for i in range(args.runs):
                ok, lines = one_run(coord.address, mode, i % 2, f"kill-{mode}-{i}")
                named += ok
                if not ok or i == 0:
                    print(f"  {mode} run {i}: {lines}", file=sys.stderr)
            print(f"| {mode} | {args.runs} | {named} of {args.runs} |", flush=True)
    finally:
        coord.stop(grace=0.2)


if __name__ == "__main__":
    main()
