"""A rank killed by a signal is the job's named failure, not the survivors it took down (`axond.worker.blame`).

Real `axond worker` processes, real ranks (native all_reduce, torch DDP over "axond"), a real SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from axond.coordinator.server import RunningCoordinator
from axond.worker.blame import blamed, pick
from axond.worker.launcher import RankExit
from kill_programs import NATIVE, TORCH
from worker_support import Procs, coord, procs, wait_for  # noqa: F401

PY = sys.executable


def _kill_and_read(coord: RunningCoordinator, procs: Procs, tmp_path: Path, source: str, nodes: int, victim: int,
                   job: str) -> list[str]:
    """Start `nodes` workers (2 ranks in all) running `source`, SIGKILL rank `victim`: every worker's last line."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {"PID_DIR": str(tmp_path)}
    args = ["worker", "--coordinator", coord.address, "--job", job, "--stop-grace", "2", "--nnodes", str(nodes),
            "--nproc-per-node", str(2 // nodes), "--", PY, str(script)]
    workers = [procs.axond(*args, env=env) for _ in range(nodes)]
    wait_for(lambda: all((tmp_path / f"pid{r}").exists() for r in (0, 1)), 120, "both ranks to start")
    os.kill(int((tmp_path / f"pid{victim}").read_text()), signal.SIGKILL)
    done = [procs.finish(w, timeout=60) for w in workers]
    assert all(d.code == 1 for d in done), [d.stderr[-2000:] for d in done]
    return [d.stderr.strip().splitlines()[-1] for d in done]


def _names_the_victim(line: str, victim: int) -> bool:
    root = line.split(" (then ")[0]
    return (re.search(rf"\brank {victim} \(\S+, pid \d+\) exited with code 137 \(SIGKILL\)", root) is not None
            and f"rank {1 - victim} (" not in root)


def test_a_sigkilled_native_rank_is_named_not_its_survivor(coord: RunningCoordinator, procs: Procs,
                                                           tmp_path: Path) -> None:
    [line] = _kill_and_read(coord, procs, tmp_path, NATIVE, 1, 1, "kill-native")
    assert _names_the_victim(line, 1), line
    assert line.endswith("(then rank 0 failed because of it)"), line


@pytest.mark.slow
def test_a_sigkilled_torch_ddp_rank_is_named(coord: RunningCoordinator, procs: Procs, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    [line] = _kill_and_read(coord, procs, tmp_path, TORCH, 1, 0, "kill-torch")
    assert _names_the_victim(line, 0), line


@pytest.mark.slow
def test_a_sigkilled_rank_on_another_node_is_named_on_both(coord: RunningCoordinator, procs: Procs,
                                                           tmp_path: Path) -> None:
    lines = _kill_and_read(coord, procs, tmp_path, NATIVE, 2, 1, "kill-two-nodes")
    assert all(_names_the_victim(line, 1) for line in lines), lines


def _exit(rank: int, code: int, at: float, blames: int | None = None, message: str = "", reported: bool = False,
          stopped: bool = False) -> RankExit:
    return RankExit(rank, rank, code, message, pid=100 + rank, hostname="h", failed_at=at, blames=blames,
                    reported=reported, stopped=stopped)


def test_blame_follows_the_chain_to_the_signal_death() -> None:
    survivor = _exit(0, 1, 10.0, blames=2, reported=True, message="DistributedError: ...")
    relay = _exit(1, 1, 10.1, blames=2, reported=True)
    killed = _exit(2, 137, 10.3)  # seen after the survivors wrote their error files
    root = pick([survivor, relay, killed])
    assert root is killed


def test_a_rank_the_worker_stopped_is_never_the_root_cause() -> None:
    timed_out = _exit(0, 1, 10.0, blames=1, reported=True, message="DistributedError: timed out waiting for peer 1")
    stopped = _exit(1, 137, 12.0, stopped=True)
    assert pick([timed_out, stopped]) is timed_out


def test_blame_reads_the_root_cause_and_the_world_peer_from_messages() -> None:
    assert blamed(_exit(0, 1, 1.0, message="DistributedError: all_reduce ...: rank 3 failed: ValueError: x")) == 3
    world = "DistributedError: all_reduce on group 'world' (rank 0 of 2): peer rank 1 closed the connection"
    assert blamed(_exit(0, 1, 1.0, message=world)) == 1
    other = "DistributedError: all_reduce on group 'g2' (rank 0 of 2): peer rank 1 closed the connection"
    assert blamed(_exit(0, 1, 1.0, message=other)) is None, "a subgroup's peer rank is not a global rank"
