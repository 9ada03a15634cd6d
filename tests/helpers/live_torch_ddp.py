"""Run by tests/worker/test_worker_live_torch.py under `axond worker --live-recovery`: torch DDP over "axond" through
`axond.torch.live.Manager`, an MLP on 3 virtual ranks.

argv: OUT_DIR HANG_STEP [CUT_STEP]. Every process records its start (`start-RANK-PID`), every committed step
(`steps-PID.jsonl`: rank, step, world size, generation, loss, time.monotonic()) and its end (`end-PID.json`: the final
loss over the whole data set, the recoveries, the state transfers to ranks that joined, a digest of the parameters).
The process that starts as rank 2 stops after committing step HANG_STEP (writes `hang-2-PID`, then sleeps; once per
run: a rank started again in its place does not) so that the test can SIGKILL it while the others wait in the next
step's gradient all-reduce; -1: nobody stops. With CUT_STEP, rank 1's commit of that step is cut
after its all-reduce completed everywhere (the others commit it): it must apply the step after the re-formation.
LIVE_TORCH_HANGS="R:S,..." (instead of HANG_STEP) stops the process that starts as rank R after step S, each once
(`hang-R-PID`); LIVE_TORCH_VIRTUAL: the virtual ranks (3); LIVE_TORCH_WAIT_JOIN=K: after committing step K, a
rank of a world smaller than the virtual ranks waits for the worker's word that a node joins; LIVE_TORCH_WRAP=fsdp2:
FSDP2 through `ShardedManager` (else DDP). LIVE_TORCH_CHECKPOINT=DIR (bench/torch_live.py's restart path, without
--live-recovery): rank 0 saves the manager's state after every committed step and every rank loads the
newest at its start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import axond.torch  # noqa: F401 -- registers "axond"
from axond.distributed import membership
from axond.torch.errors import TorchDistributedError
from axond.torch.live import Manager, batch_indices
from axond.torch.live_fsdp import FULL, ShardedManager

VIRTUAL = int(os.environ.get("LIVE_TORCH_VIRTUAL", "3"))
MICRO = 4
STEPS = 40
HANG_S = 120.0
X = torch.from_numpy(np.random.default_rng(5).standard_normal((240, 6)).astype(np.float32))
Y = ((X[:, 0] > X[:, 1]).long() + (X[:, 2] > 0.5).long())


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every rank builds (the test builds them in process for the fault-free reference)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch(step: int, v: int, virtual: int = VIRTUAL) -> tuple[torch.Tensor, torch.Tensor]:
    """Virtual rank v's micro-batch of `step`: the data are defined on virtual ranks, never on physical ones."""
    index = batch_indices(len(X), MICRO, step, v, virtual)
    return X[index], Y[index]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def final_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(loss_fn(model(X), Y))


def params_digest(model: torch.nn.Module) -> str:
    """A digest of every parameter's bytes, in state-dict order (gathered whole from FSDP2's shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    digest = hashlib.sha256()
    state = get_model_state_dict(model, options=FULL) if isinstance(model, FSDPModule) else model.state_dict()
    for value in state.values():
        digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def reference(steps: int = STEPS, virtual: int = VIRTUAL) -> float:
    """A fault-free run in one process: each step the mean over the virtual ranks of their losses' gradients."""
    model, optimizer = build()
    for step in range(steps):
        optimizer.zero_grad()
        for v in range(virtual):
            x, y = batch(step, v, virtual)
            (loss_fn(model(x), y) / virtual).backward()
        optimizer.step()
    return final_loss(model)


def cut_commit_of(step: int, manager: Manager) -> None:
    """Rank 1's commit of `step` completes its all-reduce (the others commit) but raises here, as when the all-reduce
    is cut on this rank only: the manager must apply the step after the re-formation."""
    real = dist.all_reduce
    state = {"done": False}

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = real(tensor, *args, **kwargs)
        if not state["done"] and manager.current_step() == step and tensor.dtype == torch.float64:
            state["done"] = True
            raise TorchDistributedError(f"commit of step {step} cut on this rank (the test's)", op="allreduce")
        return result
    dist.all_reduce = all_reduce  # type: ignore[assignment]


def main() -> None:
    out, hang_step = Path(sys.argv[1]), int(sys.argv[2])
    hangs = dict(tuple(map(int, h.split(":"))) for h in os.environ["LIVE_TORCH_HANGS"].split(",")) \
        if os.environ.get("LIVE_TORCH_HANGS") else {2: hang_step}
    cut_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    wait_join = int(os.environ.get("LIVE_TORCH_WAIT_JOIN", "-1"))
    dist.init_process_group("axond")
    start_rank = dist.get_rank()
    (out / f"start-{start_rank}-{os.getpid()}").write_text("")
    if os.environ.get("LIVE_TORCH_WRAP") == "fsdp2":
        manager: Manager = ShardedManager(lambda: build()[0], lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                          virtual_ranks=VIRTUAL)
    else:
        manager = Manager(*build(), virtual_ranks=VIRTUAL)
    checkpoint = Path(os.environ["LIVE_TORCH_CHECKPOINT"]) / "state.pt" if os.environ.get("LIVE_TORCH_CHECKPOINT") \
        else None
    if checkpoint is not None and checkpoint.exists():
        manager.load_state_dict(torch.load(checkpoint))
    if start_rank == 1 and cut_step >= 0:
        cut_commit_of(cut_step, manager)
    log = open(out / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")
    while manager.current_step() < STEPS:
        with manager.step() as step:
            for v in step.virtual_ranks():
                x, y = batch(manager.current_step(), v)
                step.backward(loss_fn(manager.model(x), y))
        before = manager.current_step()
        if manager.should_commit():
            manager.optimizer.step()
        if checkpoint is not None and dist.get_rank() == 0 and manager.current_step() > before:
            torch.save(manager.state_dict(), checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        if manager.current_step() > before:  # committed here, or applied after a re-formation
            log.write(json.dumps({"rank": dist.get_rank(), "step": before, "world": dist.get_world_size(),
                                  "gen": int(os.environ["AXOND_GENERATION"]), "loss": manager.loss,
                                  "mono": time.monotonic()}) + "\n")
            log.flush()
        if before == wait_join and dist.get_world_size() < VIRTUAL and manager.current_step() > before:
            membership.current().wait(90.0)  # type: ignore[union-attr]  # until the worker says a node joins
        if hangs.get(start_rank) == before and not any(out.glob(f"hang-{start_rank}-*")):
            (out / f"hang-{start_rank}-{os.getpid()}").write_text(str(time.time()))
            time.sleep(HANG_S)
    end = {"start_rank": start_rank, "rank": dist.get_rank(), "world": dist.get_world_size(),
           "generation": int(os.environ["AXOND_GENERATION"]), "final_loss": final_loss(manager.module),
           "params": params_digest(manager.module),
           "steps": manager.current_step(),
           "transfers": [{"step": t.step, "source": t.source, "joined": list(t.joined), "world": t.world,
                          "nbytes": t.nbytes, "seconds": t.seconds, "received": t.received}
                         for t in manager.transfers],
           "recoveries": [{"step": r.step, "world_before": r.world_before, "world_after": r.world_after,
                           "reason": r.reason, "error_at": r.error_at, "reformed_at": r.reformed_at,
                           "rolled_forward": r.rolled_forward, "generation": r.generation,
                           "restored": r.restored}
                          for r in manager.recoveries]}
    (out / f"end-{os.getpid()}.json").write_text(json.dumps(end))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
