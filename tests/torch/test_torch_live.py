"""`axond.torch.live` pieces in one process: the backend's `TorchMembershipChanged`, how a failure is told to be a
membership change, and the manager outside a live job (the end-to-end runs: tests/worker/test_worker_live_torch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import axond  # noqa: E402
from axond.distributed import membership  # noqa: E402
from axond.torch.errors import TorchDistributedError, TorchMembershipChanged, for_torch  # noqa: E402
from axond.torch.live import batch_indices, membership_change  # noqa: E402


def changed(generation: int = 3) -> axond.MembershipChanged:
    return axond.MembershipChanged("all_reduce on group 'torch:0' was cut: the job re-forms as generation 3 (rank 2 "
                                   "left); call axond.reform() and run the step again", generation=generation,
                                   previous_generation=generation - 1, reason="rank 2 left", op="all_reduce",
                                   group="torch:0", rank=1, peer=2)


def test_the_backend_raises_a_membership_change_torch_code_catches_as_before() -> None:
    error = for_torch(changed())
    assert isinstance(error, TorchMembershipChanged)
    assert isinstance(error, axond.MembershipChanged) and isinstance(error, dist.DistBackendError)
    assert isinstance(error, TorchDistributedError) and isinstance(error, RuntimeError)
    assert (error.generation, error.previous_generation, error.reason) == (3, 2, "rank 2 left")
    assert (error.op, error.group, error.rank, error.peer) == ("all_reduce", "torch:0", 1, 2)
    assert "axond.torch.live.Manager" in str(error) and "axond.reform()" not in str(error)
    assert for_torch(error) is error


@pytest.fixture
def live_note(tmp_path: Path) -> Iterator[Path]:
    """This process as a rank of a live job in generation 2 (its membership note at the returned path)."""
    note = tmp_path / "membership.json"
    membership.configure(str(note), 2, 5.0)
    yield note
    membership.configure(None, 0, 0.0)


def write_note(path: Path, generation: int, reason: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"generation": generation, "reason": reason, "ready": False}))
    os.replace(tmp, path)


def test_a_membership_change_is_found_through_torchs_wrapping() -> None:
    wrapped = RuntimeError("DDP reducer: all_reduce failed")
    wrapped.__cause__ = for_torch(changed())
    found = membership_change(wrapped)
    assert isinstance(found, axond.MembershipChanged) and found.generation == 3
    assert membership_change(ValueError("a bug of the user's")) is None  # not a live job: nothing waited for


def test_in_a_live_job_a_torch_error_becomes_a_membership_change_at_the_workers_word(live_note: Path) -> None:
    plain = RuntimeError("torch: the future completed with an error")
    assert membership_change(plain, wait=False) is None  # no newer generation announced
    timer = threading.Timer(0.3, write_note, (live_note, 3, "rank 2 on node n3 failed with exit code 137"))
    timer.start()
    start = time.monotonic()
    found = membership_change(plain)
    assert found is not None and found.generation == 3 and found.previous_generation == 2, found
    assert "exit code 137" in found.reason and "torch raised" in str(found)
    assert time.monotonic() - start >= 0.25
    assert membership_change(ValueError("a bug of the user's")) is None  # only torch's runtime errors are asked about


def test_outside_a_live_job_the_manager_trains_and_reform_says_what_to_do(tmp_path: Path) -> None:
    code = f"""
import torch, torch.distributed as dist, axond.torch
from axond.torch.live import Manager, reform_torch
dist.init_process_group('axond', init_method='file://{tmp_path / "rdv"}', rank=0, world_size=1)
m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
mgr = Manager(m, opt, virtual_ranks=2)
x = torch.ones(4, 2)
while mgr.current_step() < 3:
    with mgr.step() as step:
        for v in step.virtual_ranks():
            step.backward(mgr.model(x * (v + 1)).pow(2).mean())
    if mgr.should_commit():
        opt.step()
print('STEPS', mgr.current_step(), list(mgr.virtual_ranks()), round(mgr.loss, 6) > 0)
try:
    reform_torch()
except Exception as e:
    print('ERR', type(e).__name__, e)
try:
    Manager(m, opt, virtual_ranks=0, process_group=None)
except ValueError as e:
    print('VALUE', e)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AXOND_", "MASTER_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "STEPS 3 [0, 1] True" in done.stdout, done.stdout
    assert "ERR DistributedError" in done.stdout and "--live-recovery" in done.stdout, done.stdout
    assert "VALUE" in done.stdout and "process_group" in done.stdout, done.stdout


@pytest.mark.parametrize("seed", [None, 7])
def test_batch_indices_cover_each_epoch_once_on_virtual_ranks(seed: int | None) -> None:
    length, batch, virtual = 24, 2, 3  # 4 steps per epoch
    epoch = [batch_indices(length, batch, s, v, virtual, seed) for s in range(4) for v in range(virtual)]
    assert sorted(torch.cat(epoch).tolist()) == list(range(length))  # every sample once per epoch
    second = torch.cat([batch_indices(length, batch, s, v, virtual, seed) for s in range(4, 8) for v in range(virtual)])
    assert sorted(second.tolist()) == list(range(length))
    again = batch_indices(length, batch, 5, 1, virtual, seed)
    assert torch.equal(again, batch_indices(length, batch, 5, 1, virtual, seed))  # a function of (step, v) alone
    if seed is None:
        assert batch_indices(length, batch, 1, 2, virtual).tolist() == [10, 11]
    else:
        assert torch.cat(epoch).tolist() != second.tolist()  # each epoch in its own order
    straddle = batch_indices(10, 4, 0, 2, 3)  # positions 8..11 of epochs laid end to end
    assert straddle.tolist() == [8, 9, 0, 1]
    with pytest.raises(ValueError, match="0 <= v < virtual"):
        batch_indices(length, batch, 0, 3, virtual)
