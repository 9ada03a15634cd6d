"""Rank bodies of tests/torch/test_torch_backend_faults.py: torch DDP and FSDP2 over "axond" while rank 1 fails.

Each scenario runs in a fresh default group (its own FileStore): rank 1 fails at a chosen point the way a rank's
uncaught exception does (`axond.distributed.diagnostics.failure.report`: every live group is aborted with the root
cause), or dies; rank 0 trains on and reports what it raised."""

from __future__ import annotations

import os
import signal
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SCENARIOS = ["ddp-before-forward", "ddp-before-forward-async", "ddp-second-step", "ddp-in-optimizer-step",
             "fsdp2-before-forward"]
"""What rank 1 does wrong: raise before DDP's first forward (the backward's bucket all-reduces then fail; `-async`:
with the buckets on the communication thread), before its second forward (after a clean step), after its backward
(in the optimizer step), and before FSDP2's first forward (its all-gather fails)."""


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # buckets over 64 KiB, so that the async path is what runs with overlap on
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def _join(rank: int, n: int, path: str, timeout: float) -> None:
    import axond.torch  # noqa: F401 -- registers the backend

    store = dist.FileStore(path, n)
    dist.init_process_group("axond", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=timeout))


def _fail(rank: int, scenario: str) -> None:
    """Rank 1 fails here, as an uncaught exception would make it (every live group hears the cause)."""
    if rank != 1:
        return
    from axond.distributed.diagnostics.failure import report

    try:
        raise ValueError(f"bad batch on rank 1 ({scenario})")
    except ValueError as e:
        report(e)
        raise


def _train(rank: int, scenario: str) -> None:
    model = _model(0)
    if scenario.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if scenario.endswith("-async"):
            dist.group.WORLD.overlap = True  # type: ignore[union-attr]  # the AxondProcessGroup's setting
    what = scenario.split("-", 1)[1].removesuffix("-async")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if (step, what) in ((0, "before-forward"), (1, "second-step")):
            _fail(rank, scenario)
        model(torch.randn(16, 128)).sum().backward()
        if (step, what) == (0, "in-optimizer-step"):
            _fail(rank, scenario)
        opt.step()
        opt.zero_grad()


def _barrier_timeout(rank: int, n: int, store_dir: str) -> tuple[Any, ...]:
    """Rank 0 enters a barrier that rank 1 enters only after rank 0's timed out (1 s): rank 0's error."""
    _join(rank, n, os.path.join(store_dir, "store-timeout"), timeout=1.0)
    outcome: tuple[Any, ...] = ("timeout", [], "no error")
    signal_store = dist.FileStore(os.path.join(store_dir, "timed-out"), n)
    if rank == 0:
        try:
            dist.barrier()
        except Exception as e:
            outcome = ("timeout", [c.__name__ for c in type(e).__mro__], str(e))
        signal_store.set("rank 0 timed out", "1")
    else:
        signal_store.wait(["rank 0 timed out"], timedelta(seconds=30))
    dist.destroy_process_group()
    return outcome


def survives(rank: int, n: int, store_dir: str, q: Any) -> None:
    """Every scenario in turn, a barrier timeout, then rank 1 is killed (SIGKILL) before DDP's first forward;
    rank 0 puts (scenario, its error's type names, message) for each, "killed", then "alone" (a new group's rendezvous
    without rank 1) last."""
    try:
        for i, scenario in enumerate(SCENARIOS):
            _join(rank, n, os.path.join(store_dir, f"store-{i}"), timeout=20.0)
            try:
                _train(rank, scenario)
                outcome: tuple[Any, ...] = (scenario, [], "no error")
            except Exception as e:
                outcome = (scenario, [c.__name__ for c in type(e).__mro__], str(e))
            dist.destroy_process_group()
            if rank == 0:
                q.put(outcome)
        timed_out = _barrier_timeout(rank, n, store_dir)
        if rank == 0:
            q.put(timed_out)
        _join(rank, n, os.path.join(store_dir, "store-killed"), timeout=20.0)
        model = torch.nn.parallel.DistributedDataParallel(_model(0))
        dist.group.WORLD.overlap = True  # type: ignore[union-attr]
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            model(torch.randn(16, 128)).sum().backward()
            q.put(("killed", [], "no error"))
        except Exception as e:
            q.put(("killed", [c.__name__ for c in type(e).__mro__], str(e)))
        dist.destroy_process_group()
        try:  # rank 1 is dead: the rendezvous of a new group times out, inside torch's init_process_group
            _join(rank, n, os.path.join(store_dir, "store-alone"), timeout=1.0)
            q.put(("alone", [], "no error"))
        except Exception as e:
            q.put(("alone", [c.__name__ for c in type(e).__mro__], str(e)))
    except BaseException:
        q.put(("setup failed", [], traceback.format_exc()))
