"""Checkpoints that cannot vanish silently: ranks that see different checkpoint directories, and a restarted
generation that finds no checkpoint where the job saved one (the job's store at a real coordinator remembers it)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from axond.control.client import CoordinatorClient
from axond.coordinator.server import RunningCoordinator
from axond.distributed import ProcessGroup
from axond.testing import RankFailed, run_threads
from axond.train import CheckpointGuardError
from axond.train.guard import PROBE_PREFIX, SAVED_KEY
from trainer_cases import make_trainer


def _fit_recording(g: ProcessGroup, directory: Path, **options: Any) -> tuple[str | None, list[str]]:
    """fit(1) on this rank; (the checkpoint it resumed from, the guard warnings rank 0 gave)."""
    t = make_trainer(g, directory, **options)
    if g.rank != 0:
        t.fit(1)
        return t.resumed_from, []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.fit(1)
    return t.resumed_from, [str(w.message) for w in seen if "axond.train" in str(w.message)]


def test_ranks_that_see_different_checkpoint_dirs_are_told_on_every_rank(tmp_path: Path) -> None:
    def refuse(g: ProcessGroup) -> str:
        with pytest.raises(CheckpointGuardError) as e:
            make_trainer(g, tmp_path / f"node{g.rank}", checkpoint_guard="error").fit(1)
        return str(e.value)

    messages = run_threads(refuse, 2, 60.0)
    assert messages[0] == messages[1]
    assert "not one directory for every rank" in messages[0] and "rank 1 on " in messages[0]
    assert str(tmp_path / "node1") in messages[0] and "ReadWriteMany" in messages[0]

    got = run_threads(lambda g: _fit_recording(g, tmp_path / f"warned{g.rank}"), 2, 60.0)
    assert len(got[0][1]) == 1 and "not one directory for every rank" in got[0][1][0], "the default warns"

    with pytest.raises(RankFailed, match="checkpoint_guard must be one of"):
        run_threads(lambda g: make_trainer(g, tmp_path / "x", checkpoint_guard="warp"), 1, 60.0)
    shared = run_threads(lambda g: _fit_recording(g, tmp_path / "shared"), 2, 60.0)
    assert shared[0][1] == [], "a directory every rank shares raises no warning"
    assert not list((tmp_path / "shared").glob(PROBE_PREFIX + "*")), "the probe file is removed"


def _join(client: CoordinatorClient, node: str) -> int:
    return client.join("lost", node, 1, 1, 1, max_restarts=2, timeout=10.0).generation


def test_a_restart_that_finds_no_checkpoint_where_the_job_saved_one_says_so(
        coordinator: RunningCoordinator, client: CoordinatorClient, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 1 saves into ck; generation 2 looks into an empty directory (another pod's own volume)."""
    node = client.register_node("pod-0").node_id
    assert _join(client, node) == 1
    monkeypatch.setenv("AXOND_COORDINATOR", coordinator.address)
    monkeypatch.setenv("AXOND_JOB", "lost")
    monkeypatch.setenv("AXOND_GENERATION", "1")
    first = run_threads(lambda g: _fit_recording(g, tmp_path / "ck"), 2, 60.0)
    assert first[0] == (None, [])
    saved = client.store("lost", 1).try_get(SAVED_KEY)
    assert saved == f"9 {tmp_path / 'ck' / 'step_000000009'}".encode(), saved

    client.report_failure("lost", node, 1, 0, 1, "killed")
    assert _join(client, node) == 2
    assert client.store("lost", 2).try_get(SAVED_KEY) == saved, "the marker outlives the restart"
    monkeypatch.setenv("AXOND_GENERATION", "2")

    def refuse(g: ProcessGroup) -> str:
        with pytest.raises(CheckpointGuardError) as e:
            make_trainer(g, tmp_path / "empty", checkpoint_guard="error").fit(1)
        return str(e.value)

    messages = run_threads(refuse, 2, 60.0)
    assert messages[0] == messages[1]
    assert "generation 2 of job 'lost' found no complete checkpoint" in messages[0]
    assert "at step 9" in messages[0] and str(tmp_path / "empty") in messages[0]

    warned = run_threads(lambda g: _fit_recording(g, tmp_path / "empty2"), 2, 60.0)
    assert warned[0][0] is None and len(warned[0][1]) == 1 and "step 9" in warned[0][1][0], "the default warns"
    resumed = run_threads(lambda g: _fit_recording(g, tmp_path / "ck", checkpoint_guard="error"), 2, 60.0)
    assert resumed[0] == (str(tmp_path / "ck" / "step_000000009"), []), "the directory the job saved to resumes"
