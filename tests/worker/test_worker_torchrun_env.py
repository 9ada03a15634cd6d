"""An unchanged torchrun script under `axond worker`: torchrun's variables and a real torch TCPStore on MASTER_PORT.

The script is what a torchrun user writes (`torch.distributed.init_process_group(BACKEND)`, env://, nothing from
axond but the backend's import for "axond"); the worker serves torch's store as torchrun's agent does.
"""

from __future__ import annotations

import json
import sys

import pytest

from axond.coordinator.server import RunningCoordinator
from worker_support import Procs, coord, procs  # noqa: F401

pytest.importorskip("torch")

PY = sys.executable
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE")

pytestmark = pytest.mark.slow  # torchrun scripts under real workers

SCRIPT = f"""
import json, os, sys
import torch, torch.distributed as dist

if sys.argv[1] == "axond":
    import axond.torch
dist.init_process_group(sys.argv[1])
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
env = {{k: os.environ.get(k) for k in {TORCHRUN_VARS!r}}}
print("RESULT " + json.dumps({{"sum": t.item(), "env": env}}), flush=True)
dist.destroy_process_group()
"""
ENV_ONLY = (f"import json, os; env = {{k: os.environ.get(k) for k in {TORCHRUN_VARS!r}}}; "
            "print('RESULT ' + json.dumps({'env': env}))")


def _results(stdout: str) -> dict[int, dict]:  # type: ignore[type-arg]
    out = {}
    for line in stdout.splitlines():
        if "] RESULT " in line:
            prefix, payload = line.split("] RESULT ", 1)
            out[int(prefix.removeprefix("[rank "))] = json.loads(payload)
    return out


def test_unchanged_gloo_script_on_two_workers(coord: RunningCoordinator, procs: Procs) -> None:
    args = ["worker", "--coordinator", coord.address, "--job", "tr2", "--nnodes", "2", "--stop-grace", "2",
            "--max-restarts", "1", "--", PY, "-c", SCRIPT, "gloo"]
    a, b = procs.axond(*args), procs.axond(*args)
    ra, rb = procs.finish(a, timeout=120), procs.finish(b, timeout=120)
    assert ra.code == 0 and rb.code == 0, (ra.stderr[-3000:], rb.stderr[-3000:])
    results = {**_results(ra.stdout), **_results(rb.stdout)}
    assert sorted(results) == [0, 1]
    masters = {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in results.values()}
    assert len(masters) == 1, "both nodes' ranks meet at node rank 0's store"
    for rank, r in results.items():
        env = r["env"]
        assert r["sum"] == 3.0
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_RUN_ID"] == "tr2"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert env["RANK"] == env["ROLE_RANK"] == str(rank) and env["GROUP_RANK"] == str(rank)
        assert env["GROUP_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["WORLD_SIZE"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "1" and env["LOCAL_RANK"] == "0" and env["ROLE_NAME"] == "default"


def test_unchanged_script_with_the_axond_backend(procs: Procs) -> None:
    res = procs.run("worker", "--standalone", "--nproc-per-node", "2", "--stop-grace", "2", "--", PY, "-c", SCRIPT,
                    "axond", timeout=120)
    assert res.code == 0, res.stderr[-3000:]
    results = _results(res.stdout)
    assert sorted(results) == [0, 1] and all(r["sum"] == 3.0 for r in results.values())
    assert {r["env"]["GROUP_RANK"] for r in results.values()} == {"0"}


def test_without_the_store_only_the_storeless_names_are_set(procs: Procs) -> None:
    res = procs.run("worker", "--standalone", "--nproc-per-node", "2", "--", PY, "-c", ENV_ONLY,
                    env={"AXOND_TORCH_STORE": "0", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert res.code == 0, res.stderr
    for rank, r in _results(res.stdout).items():
        env = r["env"]
        assert not env["MASTER_ADDR"] and not env["MASTER_PORT"] and env["TORCHELASTIC_USE_AGENT_STORE"] is None
        assert env["TORCHELASTIC_RUN_ID"] == "default" and env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_WORLD_SIZE"] == "1"
