"""The coordinator's dashboard over HTTP (no browser): the token is required where the coordinator has one, the
data names the job, its ranks and what they are blocked in, and the Grafana dashboard in deploy/ reads metrics the
coordinator exports."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from axond.coordinator.server import RunningCoordinator
from dashboard_job import TOKEN, start_dashboard_job
from worker_support import FAST, Procs, procs, wait_for  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def test_the_dashboard_needs_the_token_and_shows_the_job(coordinator_factory: Callable[..., RunningCoordinator],
                                                         procs: Procs, tmp_path: Path) -> None:
    shown = start_dashboard_job(coordinator_factory, procs, tmp_path)
    assert _get(shown.url)[0] == 401
    assert _get(shown.url + "api/state")[0] == 401
    assert _get(shown.url + "api/state?token=wrong")[0] == 401
    assert _get(shown.url + "api/state", {"Authorization": "Bearer wrong"})[0] == 401
    status, kind, body = _get(shown.url + f"?token={TOKEN}")
    assert status == 200 and kind.startswith("text/html") and b"dashboard.js" in body
    status, kind, _ = _get(shown.url + "dashboard.js")
    assert status == 200 and kind.startswith("text/javascript"), "the script holds no data: served to anyone"
    assert _get(shown.url + "nothing-here")[0] == 404

    def state() -> dict[str, Any]:
        status, _, body = _get(shown.url + "api/state", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        data: dict[str, Any] = json.loads(body)
        return data

    def rank_zero_blocked() -> bool:
        jobs = {j["job"]: j for j in state()["jobs"]}
        ranks = {r["rank"]: r for r in jobs.get("shown", {}).get("ranks", [])}
        blocked = ranks.get(0, {}).get("blocked", "")
        return re.fullmatch(r"all_reduce on group 'world' for [\d.]+ s \(op #\d+ of the group\)", blocked) is not None

    wait_for(rank_zero_blocked, 60, "rank 0's all_reduce on the dashboard (reported after 7.5 s of a 30 s timeout)",
             0.5)
    [job] = [j for j in state()["jobs"] if j["job"] == "shown"]
    assert job["state"] == "running" and job["world_size"] == 2 and len(job["ranks"]) == 2
    assert job["ranks"][1]["blocked"] == ""
    assert set(job["goodput"]) == {"productive", "startup", "waiting_for_members", "detection", "reformation", "hung"}
    assert sum(job["goodput"].values()) == pytest.approx(job["wall_s"], rel=0.01)
    assert [n["job"] for n in state()["nodes"]] == ["shown"]


def test_without_a_token_the_dashboard_is_open(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    coord = coordinator_factory(**FAST, metrics_port=0, insecure=True)
    assert coord.metrics is not None
    status, _, body = _get(f"http://127.0.0.1:{coord.metrics.port}/api/state")
    assert status == 200 and json.loads(body)["jobs"] == []


def _grafana_metrics(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        expr = node.get("expr")
        if isinstance(expr, str):
            found |= set(re.findall(r"\baxond_[a-z_]+", expr))
        for value in node.values():
            found |= _grafana_metrics(value)
    elif isinstance(node, list):
        for value in node:
            found |= _grafana_metrics(value)
    return found


def test_the_grafana_dashboard_reads_metrics_the_coordinator_exports(
        coordinator_factory: Callable[..., RunningCoordinator], procs: Procs, tmp_path: Path) -> None:
    board = json.loads((ROOT / "deploy" / "grafana" / "axond.json").read_text())
    assert board["title"] and board["panels"]
    used = _grafana_metrics(board)
    assert {"axond_job_goodput_ratio", "axond_job_time_seconds_total", "axond_nodes"} <= used
    shown = start_dashboard_job(coordinator_factory, procs, tmp_path, job="graf")
    exported = _get(shown.url + "metrics")[2].decode()
    names = set(re.findall(r"^# TYPE (\S+) ", exported, re.M))
    assert used <= names | {n + suffix for n in names for suffix in ("_bucket", "_sum", "_count")}, used - names


def test_the_timeline_download_says_why_there_is_none(coordinator_factory: Callable[..., RunningCoordinator],
                                                      tmp_path: Path) -> None:
    coord = coordinator_factory(**FAST, metrics_port=0, insecure=True)
    assert coord.metrics is not None
    url = f"http://127.0.0.1:{coord.metrics.port}/api/timeline?job=j"
    status, _, body = _get(url)
    assert status == 404 and b"no timeline directory" in body and b"AXOND_TIMELINE" in body
    other = coordinator_factory(**FAST, metrics_port=0, insecure=True, timeline_dir=str(tmp_path))
    assert other.metrics is not None
    status, _, body = _get(f"http://127.0.0.1:{other.metrics.port}/api/timeline?job=j")
    assert status == 404 and b"no job 'j'" in body
    with urllib.request.urlopen(f"http://127.0.0.1:{other.metrics.port}/api/state", timeout=10) as r:
        assert json.loads(r.read())["timeline"] is True


def test_the_pace_is_the_step_times_where_a_rank_marks_its_steps_else_per_arrival_mark() -> None:
    from axond.observe.dashboard.view import _pace

    ms = 1_000_000
    marks = {"world": {"ranks": [0, 1], "ops": 8, "w": [[1, 0, 0], [2, 5, 40 * ms], [3, 9, 100 * ms]]}, "started": 1.0}
    assert _pace({0: marks, 1: marks}) == {"rank": 0, "kind": "ops", "group": "world", "ops": 8,
                                           "points": [[-0.06, 40.0], [0.0, 60.0]]}
    # rank 1 marks its steps (axond.mark_step()): step 4 -> 5 took 250 ms, 5 -> 6 300 ms; a gap is no step time
    steps = {**marks, "steps": [[1, 0], [4, 100 * ms], [5, 350 * ms], [6, 650 * ms]]}
    assert _pace({0: marks, 1: steps}) == {"rank": 1, "kind": "steps", "points": [[-0.3, 250.0], [0.0, 300.0]]}
    assert _pace({0: {**marks, "steps": [[1, 0]]}})["kind"] == "ops", "one step end is no step time yet"
