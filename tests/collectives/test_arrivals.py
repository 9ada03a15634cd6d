"""Arrival windows (`axond.distributed.diagnostics.arrivals`): every member counts the same collectives into the same
windows, and the member the others wait for is the one named a straggler."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from axond import ProcessGroup
from axond.config import ConfigError, RuntimeEnv, StragglerSettings
from axond.distributed.backends.base import BackendOptions
from axond.distributed.diagnostics.arrivals import report, stragglers
from axond.testing import run_threads

SLEEPER = 1
NAP_S = 0.1


def _options(**variables: str) -> BackendOptions:
    return BackendOptions(timeout=30.0, env=RuntimeEnv.from_env(variables))


def test_members_close_the_same_windows_and_the_late_one_is_named() -> None:
    def body(g: ProcessGroup) -> tuple[int, dict[str, Any]]:
        x = np.ones(8, np.float32)
        for i in range(12):  # 12 collectives: 3 windows of 4, by every way a collective runs
            if g.rank == SLEEPER:
                time.sleep(NAP_S)  # arrives last at each: the others wait for it
            if i % 3 == 0:
                g.barrier()
            elif i % 3 == 1:
                g.all_reduce(x)
            else:
                g.broadcast(x, src=0)
            if g.rank == 0:  # point-to-point ops are not counted: members run different numbers of them
                g.send(x, 2)
            elif g.rank == 2:
                g.recv(x, 0)
        return g.waited_ops, report([g])

    results = run_threads(body, 3, options=_options(AXOND_STRAGGLER_WINDOW_OPS="4", AXOND_STRAGGLER_WINDOWS="2"))
    assert [ops for ops, _ in results] == [12, 12, 12]
    reports = {rank: rep for rank, (_, rep) in enumerate(results)}
    assert [[w[0] for w in rep["world"]["w"]] for rep in reports.values()] == [[1, 2, 3]] * 3
    named = stragglers(reports, StragglerSettings(window_ops=4, windows=2))
    assert [(s.rank, s.group, s.windows, s.first_mark, s.last_mark) for s in named] == [(SLEEPER, "world", 2, 1, 3)]
    assert named[0].lost_s >= 2 * 3 * NAP_S, "the others waited about a nap per collective for it"


def test_no_window_without_recording() -> None:
    def body(g: ProcessGroup) -> tuple[int, int]:
        for _ in range(5):
            g.barrier()
        return g.waited_ops, len(g.windows)

    assert run_threads(body, 2, options=_options(AXOND_STRAGGLER_WINDOW_OPS="0")) == [(5, 0), (5, 0)]


def _reports(waits: dict[int, list[float]], wall: float = 1.0, ops: int = 100) -> dict[int, dict[str, Any]]:
    """Published marks with these waits (seconds) of each rank between two marks, each `wall` seconds apart."""
    out = {}
    for rank, per in waits.items():
        marks, ns, t = [[0, 0, 0]], 0, 0
        for k, wait in enumerate(per, start=1):
            ns, t = ns + int(wait * 1e9), t + int(wall * 1e9)
            marks.append([k, ns, t])
        out[rank] = {"world": {"ranks": sorted(waits), "ops": ops, "w": marks}}
    return out


def test_a_rank_far_below_the_others_for_k_windows_is_named_with_the_time_lost() -> None:
    settings = StragglerSettings(window_ops=100, windows=3, threshold_s=0.05, fraction=0.1)
    waits = {0: [0.3] * 4, 1: [0.32] * 4, 2: [0.31] * 4, 3: [0.01] * 4}
    (s,) = stragglers(_reports(waits), settings)
    assert (s.rank, s.windows, s.first_mark, s.last_mark, s.ops) == (3, 3, 1, 4, 300)
    assert s.lost_s == pytest.approx(0.90, abs=1e-6) and s.share == pytest.approx(0.30, abs=1e-6)
    assert "rank 3 is a straggler" in s.text() and "0.900 s more than it in the last 3.000 s" in s.text()


def test_a_window_spans_a_step_whatever_its_collectives() -> None:
    """Marks 0.1 s apart, a step every 3 marks, the others' wait for rank 2 in the first mark of each step: each
    window runs to AXOND_STRAGGLER_WINDOW_MS (300 ms: one step), so each holds one wait; while too few marks are kept
    for three such windows, the windows are shorter, some hold no wait, and nobody is named yet."""
    step = [0.25, 0.0, 0.0]
    settings = StragglerSettings(window_ops=8, window_s=0.3, windows=3)
    waits = {0: step * 4, 1: step * 4, 2: [0.0] * 12}
    (s,) = stragglers(_reports(waits, wall=0.1, ops=8), settings)
    assert (s.rank, s.first_mark, s.last_mark, s.ops) == (2, 3, 12, 72)
    assert s.lost_s == pytest.approx(0.75, abs=1e-6) and s.span_s == pytest.approx(0.9, abs=1e-6)
    early = {r: w[:6] for r, w in waits.items()}
    assert stragglers(_reports(early, wall=0.1, ops=8), settings) == []


@pytest.mark.parametrize("waits", [
    {0: [0.3, 0.3, 0.3, 0.3], 1: [0.3, 0.3, 0.3, 0.3], 2: [0.3, 0.01, 0.3, 0.3]},  # one slow window: noise
    {0: [0.3] * 4, 1: [0.3] * 4, 2: [0.28] * 4},  # below the threshold
    {0: [0.3] * 2, 1: [0.3] * 2, 2: [0.0] * 2},  # too few windows yet
    {0: [0.3] * 4},  # alone in its group
])
def test_noise_short_gaps_and_lone_ranks_are_not_named(waits: dict[int, list[float]]) -> None:
    assert stragglers(_reports(waits), StragglerSettings(window_ops=100, windows=3)) == []


def test_the_gap_must_be_a_share_of_the_window() -> None:
    waits = {0: [0.3] * 4, 1: [0.3] * 4, 2: [0.0] * 4}
    assert stragglers(_reports(waits, wall=10.0), StragglerSettings(windows=3, fraction=0.1)) == []
    assert [s.rank for s in stragglers(_reports(waits, wall=2.0), StragglerSettings(windows=3, fraction=0.1))] == [2]


def test_unreadable_windows_are_left_out() -> None:
    reports: dict[int, Any] = {0: {"world": {"w": "junk"}}, 1: {"world": 3}, 2: {"world": {"w": [[1, "x", None]]}}}
    assert stragglers(reports, StragglerSettings()) == []


@pytest.mark.parametrize(("var", "raw"), [("AXOND_STRAGGLER_WINDOW_OPS", "-1"), ("AXOND_STRAGGLER_WINDOWS", "0"),
                                          ("AXOND_STRAGGLER_WINDOWS", "16"), ("AXOND_STRAGGLER_WINDOW_MS", "-3"),
                                          ("AXOND_STRAGGLER_THRESHOLD_MS", "x"), ("AXOND_STRAGGLER_FRACTION", "1.5")])
def test_bad_settings_name_the_variable(var: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=var):
        RuntimeEnv.from_env({var: raw})
    assert RuntimeEnv.from_env({var: raw}, strict=False).stragglers == StragglerSettings()


def test_settings_are_read() -> None:
    env = RuntimeEnv.from_env({"AXOND_STRAGGLER_WINDOW_OPS": "18", "AXOND_STRAGGLER_WINDOWS": "4",
                               "AXOND_STRAGGLER_WINDOW_MS": "500", "AXOND_STRAGGLER_THRESHOLD_MS": "20",
                               "AXOND_STRAGGLER_FRACTION": "0.2"})
    assert env.stragglers == StragglerSettings(window_ops=18, window_s=0.5, windows=4, threshold_s=0.02, fraction=0.2)
