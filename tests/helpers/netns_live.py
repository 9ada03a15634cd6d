"""A live-recovery job across namespace hosts (tests/cluster/test_netns_live_*.py): a coordinator in host 0 and one
`axond worker --live-recovery --nnodes 3:4` of one rank (tests/helpers/live_train.py) on each other host."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from axond.testing.netns import Network
from netns import AXOND, Proc, base_env

HELPERS = Path(__file__).resolve().parent
TOKEN, PORT = "netns-live-token", 29500


@dataclass
class LiveJob:
    workers: list[Proc]
    out: Path
    """Where the ranks write their start, step, hang and end files."""
    argv: list[str]
    """The workers' command (a replacement worker runs the same)."""
    env: dict[str, str]


def start_live_job(net: Network, tmp_path: Path, job: str, hang_step: int, heartbeat_s: float, missed: int,
                   fence_margin: float = 1.0, worker_args: tuple[str, ...] = (), nnodes: str = "3:4",
                   **env: str) -> LiveJob:
    """Start the coordinator (lease `heartbeat_s` x `missed`) and the workers; rank 2 stops after `hang_step`. `env`:
    more variables for every process (e.g. live_train.py's LIVE_TEST_* knobs); `worker_args`: more worker flags;
    `nnodes`: the workers' --nnodes."""
    environ = base_env(tmp_path / "home", **env)
    h0, *hosts = net.hosts
    coordinator = Proc(h0, "coordinator", [*AXOND, "coordinator", "--host", h0.addr, "--port", str(PORT), "--token",
                                           TOKEN, "--heartbeat-interval", str(heartbeat_s), "--dead-after-missed",
                                           str(missed), "--settle-time", "10", "--fence-margin", str(fence_margin)],
                       environ, tmp_path)
    coordinator.wait_for("listening on", timeout=20)
    out = tmp_path / "out"
    out.mkdir()
    argv = [*AXOND, "worker", "--coordinator", f"{h0.addr}:{PORT}", "--token", TOKEN, "--nnodes", nnodes, "--job",
            job, "--live-recovery", "--join-timeout", "60", *worker_args, "--", sys.executable,
            str(HELPERS / "live_train.py"), str(out), str(hang_step)]
    return LiveJob([Proc(h, f"worker{h.index}", argv, environ, tmp_path) for h in hosts], out, argv, environ)
