"""The fault-injection matrix of tests/torch/test_torch_faults.py: torch DDP and FSDP2 (`fully_shard` on a cpu
DeviceMesh) over "axond", two forked ranks per case; rank 1 raises, exits (`sys.exit(3)`) or is killed (SIGKILL) at one
point of its third training step, and rank 0 (the survivor) reports what it caught.

    python tests/helpers/torch_fault_cases.py --out results.json [CASE ...]     # CASE: wrapper-where-how; default all

Points: before the forward; in the backward while DDP's gradient buckets are being all-reduced (a gradient hook on
the first layer, whose gradient comes last); in the optimizer step; inside FSDP2's all-gather (its second of the
step, so mid-forward) and reduce-scatter (its second of the step, mid-backward).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from forked_ranks import describe, join, run_ranks

OP_TIMEOUT = 20.0
"""Seconds a collective may wait (the group's timeout): a survivor must raise long before, since the peer's
failure is known at once; a survivor that waits this long has not been told."""
CASE_DEADLINE = OP_TIMEOUT + 20.0
"""Seconds after which a case's ranks are killed (the test then fails: something hung)."""
FAILING, FAULT_STEP, STEPS = 1, 2, 4
"""Rank 1 fails in step 2: steps 0 and 1 are clean (DDP rebuilds its buckets at the start of step 1, a broadcast)."""
MESSAGE = "injected fault on rank 1"

WHERE = {"ddp": ["before_forward", "backward", "optimizer_step"],
         "fsdp": ["before_forward", "all_gather", "reduce_scatter", "optimizer_step"]}
HOW = ["raise", "exit", "kill"]
CASES = [f"{w}-{where}-{how}" for w, wheres in WHERE.items() for where, how in itertools.product(wheres, HOW)]


def fault(how: str) -> None:
    """Fail as a user's rank does: an exception, sys.exit(3), or SIGKILL."""
    if how == "raise":
        raise ValueError(MESSAGE)
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def build(wrapper: str) -> torch.nn.Module:
    """Four linear layers; DDP with small buckets (one per layer or so), FSDP2 with one unit per layer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class Armed:
    """A fault waiting for its point: `fire()` fails when armed (at the point's `nth` call within the step)."""

    def __init__(self, how: str, nth: int = 1) -> None:
        self.how, self.nth, self.armed, self.calls = how, nth, False, 0

    def fire(self) -> None:
        if self.armed:
            self.calls += 1
            if self.calls == self.nth:
                fault(self.how)


def _wrap_collective(name: str, armed: Armed) -> None:
    """Make torch.distributed.<name> (what FSDP2 calls) fail at the armed call, before the real op."""
    real: Callable[..., Any] = getattr(dist, name)

    def op(*args: Any, **kwargs: Any) -> Any:
        armed.fire()
        return real(*args, **kwargs)

    setattr(dist, name, op)


def arm(wrapper: str, where: str, how: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Armed:
    """Install rank 1's fault at its point; it fires once `armed` is set (in step FAULT_STEP)."""
    armed = Armed(how, nth=2 if where in ("all_gather", "reduce_scatter") else 1)
    if where == "backward":
        first = model.module[0] if wrapper == "ddp" else model[0]
        first.weight.register_hook(lambda grad: armed.fire())
    elif where == "optimizer_step":
        opt.register_step_pre_hook(lambda *_: armed.fire())
    elif where == "all_gather":
        _wrap_collective("all_gather_single", armed)
    elif where == "reduce_scatter":
        _wrap_collective("reduce_scatter_single", armed)
    return armed


def rank_body(case: str) -> Callable[[int, int, str], Any]:
    wrapper, where, how = case.split("-")

    def body(rank: int, size: int, shared: str) -> Any:
        join(rank, size, shared, "axond", OP_TIMEOUT)
        model = build(wrapper)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        armed = arm(wrapper, where, how, model, opt) if rank == FAILING else Armed(how)
        gen = torch.Generator().manual_seed(rank)
        began = time.monotonic()
        try:
            for step in range(STEPS):
                x = torch.randn(8, 64, generator=gen)
                armed.armed = step == FAULT_STEP and rank == FAILING
                if step == FAULT_STEP:
                    began = time.monotonic()
                if where == "before_forward":
                    armed.fire()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        except Exception as e:
            if rank == FAILING:
                raise
            return {"caught": describe(e), "after": round(time.monotonic() - began, 2)}
        return {"finished": STEPS}

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="*", help="default: every case")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; the cases are {CASES}")
    import axond.torch  # noqa: F401 -- imported once, before the ranks are forked
    import torch._dynamo
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.nn.parallel  # noqa: F401

    results = {}
    for case in args.cases or CASES:
        results[case] = run_ranks(rank_body(case), 2, CASE_DEADLINE)
        print(f"{case}: codes {results[case]['codes']} in {results[case]['seconds']} s", file=sys.stderr, flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
