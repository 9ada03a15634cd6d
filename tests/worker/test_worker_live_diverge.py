"""A diverged replica's node is left out of a live job: a real `axond coordinator`, three `axond worker
--live-recovery` nodes, DistributedTrainer (ddp on virtual ranks, `digest_every`, no checkpoint directory), and one
bit of rank 2's parameters flipped after a step. At the next check rank 2 is named and raises; its node leaves; ranks
0 and 1 go back to the state agreed at the check before, in memory, and train on at world size 2 in the same
processes, ending bit for bit where a run without the fault ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from axond.distributed import ProcessGroup
from axond.testing import run_threads
from live_train import Hashes, build_trainer
from worker_support import Procs, free_port, procs  # noqa: F401

PY = sys.executable
SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_diverge.py"
FLIP_STEP, EVERY, STEPS = 12, 5, 60
"""Rank 2's bit flips after step 12; the check after step 15 names it; the state of step 10 was the last agreed."""


def reference_hashes() -> list[str]:
    """The parameters after every step of one process training the three virtual ranks without a fault."""
    def train(group: ProcessGroup) -> list[str]:
        hashes = Hashes()
        build_trainer(group, [hashes], virtual_ranks=3, digest_every=EVERY).fit(3)
        return hashes.hashes

    (hashes,) = run_threads(train, 1, timeout=120.0)
    return hashes


@pytest.mark.slow
def test_the_diverged_replicas_node_leaves_and_the_others_go_on_from_the_agreed_state(procs: Procs,
                                                                                       tmp_path: Path) -> None:
    want = reference_hashes()
    assert len(want) == STEPS
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", "0.2", "--dead-after-missed", "15", "--settle-time", "5")
    out = tmp_path / "out"
    out.mkdir()
    workers = [procs.axond("worker", "--coordinator", f"127.0.0.1:{port}", "--nnodes", "2:3", "--job", "diverge",
                           "--live-recovery", "--join-timeout", "60", "--", PY, str(SCRIPT), str(out),
                           str(FLIP_STEP), str(EVERY)) for _ in range(3)]
    finished = [procs.finish(w, timeout=120) for w in workers]
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    loser = next(f for f in finished if f.code != 0)
    assert "ReplicaDivergence" in loser.stderr and "goes on without this node" in loser.stderr, loser.stderr[-2000:]

    started = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in out.glob("start-*")}  # pid -> rank
    assert sorted(started.values()) == [0, 1, 2]  # three processes ever: none restarted
    (diverged,) = out.glob("diverged-*.txt")
    assert started[int(diverged.stem.split("-")[1])] == 2
    assert "replicas disagree after step 15" in diverged.read_text() and "rank(s) [2]" in diverged.read_text()
    ends = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("end-*.json")}
    assert sorted(started[pid] for pid in ends) == [0, 1]  # the survivors finished in the processes they began in
    for pid, end in ends.items():
        assert end["world"] == 2 and end["restored"] == [[15, 10]], end
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"]) == (3, 2), recovery
        done = [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in done] == list(range(1, 16)) + list(range(11, STEPS + 1))
        assert [s["hash"] for s in done[:10]] == want[:10]  # before the fault
        assert [s["hash"] for s in done[15:]] == want[10:]  # the replay from the agreed state: as if no fault
        assert done[14]["hash"] != want[14], "rank 2's wrong weights reached every replica's gradient before the check"
