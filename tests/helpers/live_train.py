"""Run by tests/worker/test_worker_live_recovery.py under `axond worker --live-recovery`: an MLP on virtual ranks.

argv: OUT_DIR HANG_STEP [CHECKPOINT_DIR]. Every process records its start (`start-RANK-PID`), every step
(`steps-PID.jsonl`: rank, global step, world size, generation, wall and monotonic time) and its end (`end-PID.json`,
`params-PID.npz`). The process that starts as rank 2 stops after its step HANG_STEP (writes `hang-PID`, then
sleeps until a file `go` appears in OUT_DIR) so that the test can SIGKILL (or SIGSTOP) it while the others wait in
the next step's collectives; HANG_STEP -1: nobody stops; it stops once per run (a restarted rank 2 does not).
LIVE_TEST_HANG_RANKS=2,3: the ranks that stop so (default 2).
With CHECKPOINT_DIR (today's restart path, for bench/recovery.py) the trainer checkpoints after every step.
LIVE_TEST_PARALLEL (the worker's environment): the trainer's `parallel` ("ddp" unless given; "zero": ZeRO-1 with
buddy copies); LIVE_TEST_COPY_EVERY: its `copy_every` ("none": no buddy copies); LIVE_TEST_HANG_IN="post": the rank
that stops does so after step HANG_STEP's update and parameter gather but before it posts that step's buddy copy (its
buddy then holds the copy of the step before); "daemon": likewise before it copies that step into its worker daemon's
memory (the replacement then finds the copy of the step before there).

LIVE_TEST_ROLE (the worker's environment) changes who stops: "bystander": none of this worker's ranks; "stubborn":
its local rank 0 stops, and its local rank 1 ignores SIGTERM and writes time.monotonic() to `alive-PID` every
10 ms until it is killed (what the fencing test watches).
LIVE_TEST_WAIT_JOIN=K[:W] (tests/worker/test_worker_live_join.py): after step K every rank of a world smaller than W
(default 3) waits for the worker's word of the job's next generation (a node joining). LIVE_TEST_PACE_S=S: every rank
of such a world sleeps S seconds after each step (a node then joins mid-run, wherever the steps are).
LIVE_TEST_GROUP_TIMEOUT_S: the default group's timeout (30 s unless given); LIVE_TEST_START_TOGETHER=1: the first
ranks wait for each other before forming the group (so that a short timeout bounds the ops, not the start).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import axond
from axond import nn
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.train import Callback, DistributedTrainer

X = np.random.default_rng(5).standard_normal((240, 6)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int64) + (X[:, 2] > 0.5)
HANG_S = 120.0
GROUP_TIMEOUT_S = float(os.environ.get("LIVE_TEST_GROUP_TIMEOUT_S", "30"))
"""The default group's timeout: how long the survivors would wait in a collective on a peer that never answers
(LIVE_TEST_GROUP_TIMEOUT_S; what bounds the detection of a link cut between two nodes that keep their leases)."""


def build_trainer(group: ProcessGroup | None, callbacks: list[Callback], **options: Any) -> DistributedTrainer:
    """The trainer every rank builds (the tests also build it in-process, as the reference of per-step hashes)."""
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(6, 16, rng=rng), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3, rng=rng))
    return DistributedTrainer(model, lambda params: AdamW(params, lr=0.01), nn.CrossEntropyLoss(), (X, Y),
                              batch_size=4, progress=False, clip_norm=1.0, callbacks=callbacks, group=group,
                              **options)


def params_hash(trainer: DistributedTrainer) -> str:
    """A digest of every parameter's bytes, in state-dict order."""
    digest = hashlib.sha256()
    for value in trainer.module.state_dict().values():
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:16]


class Hashes(Callback):
    """The parameters' digest after every step."""

    def __init__(self) -> None:
        self.hashes: list[str] = []

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        self.hashes.append(params_hash(trainer))


class Record(Callback):
    def __init__(self, out: Path, hang_step: int) -> None:
        role = os.environ.get("LIVE_TEST_ROLE", "")
        self.out, self.hang_step = out, hang_step
        hang_ranks = os.environ.get("LIVE_TEST_HANG_RANKS", "2").split(",")
        self.hangs = (role == "" and os.environ["RANK"] in hang_ranks) or (
            role == "stubborn" and os.environ["LOCAL_RANK"] == "0")
        self.log = open(out / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")  # closed at exit
        wait = os.environ.get("LIVE_TEST_WAIT_JOIN", "-1").split(":")
        self.wait_join, self.full_world = int(wait[0]), int(wait[1]) if len(wait) > 1 else 3
        self.pace = float(os.environ.get("LIVE_TEST_PACE_S", "0"))

    def on_fit_start(self, trainer: DistributedTrainer) -> None:
        where = os.environ.get("LIVE_TEST_HANG_IN")
        copies = trainer.virtual.copies if trainer.virtual is not None else None
        daemon = trainer.virtual.daemon if trainer.virtual is not None else None
        if self.hangs and where == "post" and copies is not None:
            self.hangs, post = False, copies.post  # stops before posting its copy of HANG_STEP, not after the step

            def hang_then_post() -> None:
                if copies.zero.tag == self.hang_step:
                    self.hang()
                post()
            copies.post = hang_then_post  # type: ignore[method-assign]
        if self.hangs and where == "daemon" and daemon is not None:
            self.hangs, write = False, daemon.post  # stops before copying HANG_STEP into its daemon's memory

            def hang_then_write(lineage: int) -> None:
                if daemon.zero.tag == self.hang_step:
                    self.hang()
                write(lineage)
            daemon.post = hang_then_write  # type: ignore[method-assign]

    def hang(self) -> None:
        once = self.out / f"hung-rank{os.environ['RANK']}"  # once per run: a restarted rank does not stop again
        if not once.exists():
            once.write_text("")
            (self.out / f"hang-{os.getpid()}").write_text(str(time.time()))
            deadline = time.monotonic() + HANG_S
            while time.monotonic() < deadline and not (self.out / "go").exists():
                time.sleep(0.01)

    def on_step_end(self, trainer: DistributedTrainer, metrics: dict[str, float]) -> None:
        step = int(metrics["global_step"])
        self.log.write(json.dumps({"rank": trainer.rank, "step": step, "world": trainer.world_size,
                                   "gen": int(os.environ["AXOND_GENERATION"]), "t": time.time(),
                                   "hash": params_hash(trainer),
                                   "mono": time.monotonic()}) + "\n")
        self.log.flush()
        if self.pace and trainer.world_size < self.full_world:
            time.sleep(self.pace)
        if step == self.wait_join and trainer.world_size < self.full_world:
            wait_for_next_generation()
        if self.hangs and step == self.hang_step:
            copies = trainer.virtual.copies if trainer.virtual is not None else None
            if os.environ.get("LIVE_TEST_HANG_AFTER_COPY") and copies is not None:
                copies.settle()  # its buddy copy of this step landed before it stops
            self.hang()


def wait_for_next_generation(timeout: float = 90.0) -> None:
    """Stay at this step boundary until the worker says the job moves on (a node joins): the test starts the
    replacement while the survivors wait here, so that it joins at this boundary whatever the machine's speed."""
    from axond.distributed import membership

    live = membership.current()
    if live is not None:
        live.wait(timeout)


def stamp_until_killed(path: Path) -> None:
    """Ignore SIGTERM; write time.monotonic() to `path` every 10 ms (a daemon thread: until SIGKILL ends it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    tmp = path.with_name(f".{path.name}.tmp")  # replaced whole: a SIGKILL mid-write never leaves it empty

    def loop() -> None:
        while True:
            tmp.write_text(repr(time.monotonic()))
            os.replace(tmp, path)
            time.sleep(0.01)

    threading.Thread(target=loop, daemon=True).start()


def start_together(out: Path, rank: int, world: int, timeout: float = 120.0) -> None:
    """Wait until every first rank got here (a short group timeout also bounds the group's forming: a rank whose
    interpreter starts late on a busy machine must not make the others' forming time out)."""
    (out / f"ready-{rank}").write_text("")
    deadline = time.monotonic() + timeout
    while len(list(out.glob("ready-*"))) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    out, hang_step = Path(sys.argv[1]), int(sys.argv[2])
    options: dict[str, Any] = {"checkpoint_dir": sys.argv[3], "checkpoint_every": 1} if len(sys.argv) > 3 else {}
    options["parallel"] = os.environ.get("LIVE_TEST_PARALLEL", "ddp")
    if os.environ.get("LIVE_TEST_COPY_EVERY"):
        every = os.environ["LIVE_TEST_COPY_EVERY"]
        options["copy_every"] = None if every == "none" else int(every)
    if os.environ.get("LIVE_TEST_ROLE") == "stubborn" and os.environ["LOCAL_RANK"] == "1":
        stamp_until_killed(out / f"alive-{os.getpid()}")
    (out / f"start-{os.environ['RANK']}-{os.getpid()}").write_text("")
    first_generation = os.environ["AXOND_GENERATION"]
    if os.environ.get("LIVE_TEST_START_TOGETHER") and first_generation == "1":
        start_together(out, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    axond.init_process_group("tcp", timeout=GROUP_TIMEOUT_S)
    trainer = build_trainer(None, [Record(out, hang_step)], **options)
    history = trainer.fit(3)
    np.savez(out / f"params-{os.getpid()}.npz", **trainer.module.state_dict())
    recoveries = [dataclasses.asdict(r) for r in trainer.virtual.recoveries] if trainer.virtual else []
    transfers = [dataclasses.asdict(t) for t in trainer.virtual.transfers] if trainer.virtual else []
    copies = trainer.virtual.copies if trainer.virtual else None
    relayed = {"relayed": copies.relayed is not None, "unsent": copies.unsent} if copies is not None else {}
    (out / f"end-{os.getpid()}.json").write_text(json.dumps({
        "pid": os.getpid(), "rank": trainer.rank, "world": trainer.world_size, "recoveries": recoveries,
        "transfers": transfers, **relayed,
        "losses": [h["loss"] for h in history], "generation": os.environ["AXOND_GENERATION"],
        "first_generation": first_generation,
        "mono": time.monotonic(), "wall": time.time()}))
    axond.destroy_process_group()


if __name__ == "__main__":
    main()
