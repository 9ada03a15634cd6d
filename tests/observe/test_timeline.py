"""AXOND_TIMELINE: a 2-rank DDP job under a real worker writes one trace per rank; `axond timeline merge` joins them.

The merged file is checked against the trace-event format (a small validator below), and shows every
collective: both ranks list the same collectives in the same order (every collective is called by every
member), each DDP bucket is one async all_reduce of its bytes, and the checkpoint save is there.
"""

from __future__ import annotations

import json
import numbers
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from axond.coordinator.server import RunningCoordinator
from axond.observe.merge import merge
from worker_support import FAST, Procs, procs  # noqa: F401

STEPS = 6
DDP_SCRIPT = f"""
import json, os, sys
import numpy as np
import axond
import axond.checkpoint
from axond import nn
from axond.nn.optim import SGD
from axond.parallel import DDP

group = axond.init_process_group("tcp")
rng = np.random.default_rng(group.rank)
model = nn.Sequential(nn.Linear(16, 64, rng=rng), nn.ReLU(), nn.Linear(64, 64, rng=rng), nn.ReLU(),
                      nn.Linear(64, 4, rng=rng))
ddp = DDP(model, group, bucket_cap_mb=0.01)  # ~10 KiB buckets: several per step
opt = SGD(list(model.parameters()), lr=0.05)
loss = nn.MSELoss()
for step in range({STEPS}):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 4)).astype(np.float32)
    model.zero_grad()
    loss(ddp(x), y)
    ddp.backward(loss.backward())
    opt.step()
axond.barrier()
model_sd, _ = axond.checkpoint.get_state_dict(ddp, opt)
axond.checkpoint.save({{"model": model_sd}}, sys.argv[1])
if group.rank == 0:
    print("BUCKETS " + json.dumps(len(ddp.buckets)), flush=True)
axond.destroy_process_group()
"""

PHASES = {"X", "B", "E", "i", "I", "M", "C", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"}


def validate_trace(trace: Any) -> list[dict[str, Any]]:
    """Check `trace` against Chrome's trace-event format (JSON object form); returns its events."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list), "an object with traceEvents"
    if "displayTimeUnit" in trace:
        assert trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    for e in events:
        where = f"event {e!r}"
        assert isinstance(e, dict), where
        assert isinstance(e.get("name"), str) and e["name"], f"{where}: name"
        assert e.get("ph") in PHASES, f"{where}: ph"
        for key in ("pid", "tid"):
            assert isinstance(e.get(key), int) and not isinstance(e[key], bool), f"{where}: {key} is an integer"
        assert isinstance(e.get("ts"), numbers.Real) and not isinstance(e["ts"], bool), f"{where}: ts"
        if "args" in e:
            assert isinstance(e["args"], dict), f"{where}: args"
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), numbers.Real) and e["dur"] >= 0, f"{where}: dur"
            assert e["ts"] >= 0, f"{where}: merged timestamps start at 0"
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index",
                                 "process_labels"), f"{where}: a known metadata event"
            assert isinstance(e.get("args"), dict), f"{where}: metadata has args"
    json.dumps(trace, allow_nan=False)  # no NaN/Infinity: the viewers' JSON parsers refuse them
    return events


@pytest.mark.slow
def test_a_ddp_job_timeline_merges_into_a_valid_trace_with_every_collective(
    coordinator_factory: Callable[..., RunningCoordinator], procs: Procs, tmp_path: Path,
) -> None:
    coord = coordinator_factory(**FAST)
    script, timeline_dir, out = tmp_path / "ddp.py", tmp_path / "timeline", tmp_path / "merged.json"
    script.write_text(DDP_SCRIPT)
    res = procs.run("worker", "--coordinator", coord.address, "--job", "traced", "--nproc-per-node", "2", "--",
                    sys.executable, str(script), str(tmp_path / "ckpt"), env={"AXOND_TIMELINE": str(timeline_dir)},
                    timeout=90)
    assert res.code == 0, res.stderr
    buckets = int(next(line.split("BUCKETS ")[1] for line in res.stdout.splitlines() if "BUCKETS " in line))
    assert buckets >= 2
    assert len(list(timeline_dir.glob("rank-*.json"))) == 2

    merged = procs.run("timeline", "merge", str(timeline_dir), "-o", str(out))
    assert merged.code == 0, merged.stderr
    events = validate_trace(json.loads(out.read_text()))

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {p for p, _ in names} == {0, 1} and {e["args"]["name"] for e in events if e["name"] == "process_name"} \
        == {"rank 0", "rank 1"}
    timed = [e for e in events if e["ph"] == "X"]
    per_rank: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for e in sorted(timed, key=lambda e: e["ts"]):
        per_rank[e["pid"]].append(e)

    def collectives(rank: int) -> list[tuple[str, str, int]]:
        return [(e["name"], e["args"]["group"], e["args"]["bytes"]) for e in per_rank[rank] if e["cat"] == "collective"]

    assert collectives(0) == collectives(1), "every collective of one rank is there on the other, in order"
    for rank in (0, 1):
        mine = per_rank[rank]
        bucket_events = [e for e in mine if e["name"] == "ddp.bucket"]
        assert len(bucket_events) == STEPS * buckets
        bucket_reduces = [e for e in mine if e["name"] == "all_reduce" and e["args"].get("async")]
        assert sorted(e["args"]["bytes"] for e in bucket_reduces) == sorted(e["args"]["bytes"] for e in bucket_events)
        assert all(e["args"]["path"] in ("mailbox", "arena", "single_copy", "sockets", "two_level") for e in mine
                   if e["cat"] == "collective")
        for e in bucket_events:
            assert names[(rank, e["tid"])] == "training"
        assert [e["name"] for e in mine if e["cat"] == "checkpoint"] == ["checkpoint.save"]
        assert sum(1 for e in mine if e["name"] == "barrier") >= 1
        assert sum(1 for e in mine if e["name"] == "broadcast") >= 1, "DDP's start broadcasts rank 0's parameters"


def test_a_killed_ranks_open_file_still_merges_on_one_clock(tmp_path: Path) -> None:
    """Two ranks whose monotonic clocks differ by 1000 s but whose wall clocks agree line up; an unclosed array
    (a rank killed before exit) is read."""
    def clock(rank: int, mono_us: float) -> dict[str, Any]:
        return {"name": "axond_clock", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                "args": {"wall_us": 5e15, "mono_us": mono_us, "rank": str(rank)}}

    def op(rank: int, ts: float) -> dict[str, Any]:
        return {"name": "all_reduce", "cat": "collective", "ph": "X", "pid": rank, "tid": 1, "ts": ts, "dur": 10.0,
                "args": {"group": "world", "bytes": 8, "path": "sockets"}}

    (tmp_path / "rank-0-pid-1.json").write_text(json.dumps([clock(0, 1e6), op(0, 1e6 + 500)]))
    open_array = "[\n" + ",\n".join(json.dumps(e) for e in (clock(1, 1e9), op(1, 1e9 + 520))) + ",\n"
    (tmp_path / "rank-1-pid-2.json").write_text(open_array)
    events = validate_trace(merge(tmp_path))
    starts = {e["pid"]: e["ts"] for e in events if e["ph"] == "X"}
    assert starts == {0: 0.0, 1: 20.0}


def test_merge_says_what_is_missing(procs: Procs, tmp_path: Path) -> None:
    res = procs.run("timeline", "merge", str(tmp_path), "-o", str(tmp_path / "out.json"))
    assert res.code == 1 and "holds no rank-*.json timeline files" in res.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_an_unwritable_timeline_directory_is_reported_not_fatal(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = ("import numpy as np; from axond.testing import run_threads; "
            "print(run_threads(lambda g: float(g.all_reduce(np.ones(2)) or 1), 2))")
    env = {**os.environ, "AXOND_TIMELINE": str(blocker / "timeline")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "[1.0, 1.0]" in res.stdout
    assert "cannot write a timeline there" in res.stderr
