"""The rank program of `bench/soak.py --torch`: torch DDP over "axond" through `axond.torch.live.Manager` on a small MLP
(a few MB) under `axond worker --live-recovery`, for as long as the soak lasts.

argv: OUT_DIR. The same logs as bench/soak_train.py: `start-PID`, then one line per committed step to
`steps-PID.jsonl` (committed steps, world size, generation, the step's loss: the mean over the virtual ranks, None
for a step this rank applied after a re-formation; time.monotonic() at the step's end), one line per re-formation
(`kind: "recovery"`) and per state sent to or taken by a joining rank (`kind: "transfer"`). At the stop file's step
every rank writes `end-PID.json` (the final loss over the whole data set, a digest of the parameters) and leaves.

SOAK_HIDDEN (the MLP's width, default 512: 0.55 M float32 parameters, 2.1 MiB). `build` and `reference` are also the
soak's fault-free run (one process, the same four virtual ranks). `python bench/soak_train_torch.py --rounding STEPS`
prints how far two fault-free runs drift apart when only the order of the four gradients' sum differs: the float
noise under the soak's loss comparison.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import axond.torch  # noqa: F401 -- registers "axond"
from axond.torch.live import Manager, batch_indices

FEATURES, CLASSES, SAMPLES, BATCH, VIRTUAL = 32, 10, 4096, 8, 4
"""4096 samples over 4 virtual ranks at batch 8: 128 steps an epoch."""
SEED = 11
MAX_STEPS = 10_000_000
"""More than any soak runs: the stop file ends it."""


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = ((x[:, 0] > x[:, 1]).astype(np.int64) * 5 + (x[:, 2] > 0.3) + (x[:, 3] > 0.6)) % CLASSES
    return torch.from_numpy(x), torch.from_numpy(y)


X, Y = dataset()


def build(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                torch.nn.Tanh(), torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, CLASSES))
    # SGD with momentum (its buffers travel to a joining rank) at a small step: the float rounding of DDP's sums (in
    # another order than the one-process reference's, and in yet another at each world size) grows with the training's
    # sensitivity; at lr 0.05, momentum 0.9 two fault-free orders of the same sums differed by 23 % in the loss after
    # 1000 steps (bench/results/2026-12-07-torch-soak.md), so the comparison measured rounding, not recovery
    return model, torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.5)


def batch(step: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = batch_indices(SAMPLES, BATCH, step, v, VIRTUAL, SEED)
    return X[index], Y[index]


def final_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(X), Y))


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def reference(hidden: int, steps: int) -> tuple[list[float], float]:
    """A fault-free run in one process: each step the mean over the four virtual ranks of their losses' gradients;
    (the loss of each step, index = committed steps after it; the final loss after `steps`)."""
    torch.set_num_threads(1)
    model, optimizer = build(hidden)
    losses = [float("nan")]
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for v in range(VIRTUAL):
            x, y = batch(step, v)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            total += float(loss.detach())
            (loss / VIRTUAL).backward()
        optimizer.step()
        losses.append(total / VIRTUAL)
    return losses, final_loss(model)


def rounding(hidden: int, steps: int) -> None:
    """The float noise the loss comparison sits on: the fault-free run twice in one process, the four virtual ranks'
    gradients summed in two orders (((g0 + g1) + g2) + g3, as `reference`; (g0 + g1) + (g2 + g3), as two ranks of
    two might), the largest relative difference of a step's loss so far and of the final loss printed."""
    torch.set_num_threads(1)
    losses: list[list[float]] = [[], []]
    finals = []
    for order in (0, 1):
        model, optimizer = build(hidden)
        for step in range(steps):
            grads, total = [], 0.0
            for v in range(VIRTUAL):
                model.zero_grad()
                x, y = batch(step, v)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                total += float(loss.detach())
                (loss / VIRTUAL).backward()
                grads.append([q.grad.clone() for q in model.parameters()])  # type: ignore[union-attr]
            for i, q in enumerate(model.parameters()):
                g = [one[i] for one in grads]
                q.grad = ((g[0] + g[1]) + g[2]) + g[3] if order == 0 else (g[0] + g[1]) + (g[2] + g[3])
            optimizer.step()
            losses[order].append(total / VIRTUAL)
        finals.append(final_loss(model))
    worst = 0.0
    for step, (a, b) in enumerate(zip(*losses), 1):
        worst = max(worst, abs(a - b) / abs(a))
        if step % 500 == 0 or step == steps:
            print(f"step {step}: loss {a:.6g}, largest relative difference of a step's loss so far {worst:.2e}")
    print(f"final loss {finals[0]:.9g} / {finals[1]:.9g}: {abs(finals[0] - finals[1]) / abs(finals[0]):.2e} relative")


def main() -> None:
    if sys.argv[1] == "--rounding":  # python bench/soak_train_torch.py --rounding STEPS
        rounding(int(os.environ.get("SOAK_HIDDEN", "512")), int(sys.argv[2]))
        return
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    (out / f"start-{os.getpid()}").write_text(json.dumps({
        "host": socket.gethostname(), "rank": int(os.environ["RANK"]), "gen": int(os.environ["AXOND_GENERATION"]),
        "mono": time.monotonic()}))
    dist.init_process_group("axond")
    model, optimizer = build(int(os.environ.get("SOAK_HIDDEN", "512")))
    manager = Manager(model, optimizer, virtual_ranks=VIRTUAL)
    log = open(out / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")
    stop_file, stop_at = out / "stop", None
    seen_recoveries = seen_transfers = 0
    while manager.current_step() < MAX_STEPS:
        with manager.step() as step:
            for v in step.virtual_ranks():
                x, y = batch(manager.current_step(), v)
                step.backward(torch.nn.functional.cross_entropy(manager.model(x), y))
        before = manager.current_step()
        if manager.should_commit():
            optimizer.step()
        lines: list[dict[str, Any]] = []
        for r in manager.recoveries[seen_recoveries:]:
            lines.append({"kind": "recovery", **dataclasses.asdict(r)})
        for t in manager.transfers[seen_transfers:]:
            lines.append({"kind": "transfer", **dataclasses.asdict(t)})
        seen_recoveries, seen_transfers = len(manager.recoveries), len(manager.transfers)
        committed = manager.current_step()
        if committed > before:  # committed here, or applied after a re-formation
            lines.append({"kind": "step", "step": committed, "world": dist.get_world_size(), "rank": dist.get_rank(),
                          "gen": int(os.environ["AXOND_GENERATION"]), "loss": manager.loss,
                          "mono": time.monotonic()})
        log.write("".join(json.dumps(line) + "\n" for line in lines))
        log.flush()
        if stop_at is None and stop_file.exists():
            text = stop_file.read_text().strip()
            stop_at = int(text) if text else None
        if stop_at is not None and committed >= stop_at:
            (out / f"end-{os.getpid()}.json").write_text(json.dumps({
                "step": committed, "final_loss": final_loss(manager.module), "params": digest(manager.module),
                "world": dist.get_world_size()}))
            log.close()
            os._exit(0)  # every rank leaves after the same step; nothing more is sent
    raise SystemExit(f"the soak ran out of its {MAX_STEPS} steps before its stop file ended it")


if __name__ == "__main__":
    main()
