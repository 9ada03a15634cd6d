"""A rank's failure reaches the others once and short: the root cause in one `DistributedError` line, the
error file the worker reads, `axond.record`; AXOND_DEBUG=1 keeps the transport's frames. Real ranks:
subprocesses for uncaught exceptions, threads over loopback TCP for the group-level behaviour."""

from __future__ import annotations

import json
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.diagnostics.failure import abort_group
from axond.distributed.process_group import ProcessGroup
from axond.errors import DistributedError
from axond.testing import run_module_ranks, run_on, thread_groups

CAUSE = "rank 1 failed: ValueError: bad batch shape (3, 5)"
INTERNAL = ("framing.py", "peer.py", "mailbox.py", "tcp/backend.py", "placement.py", "doubling.py", "ring.py")

RANK_MAIN = """
import numpy as np
import axond

axond.init_process_group("tcp", timeout=20)
x = np.ones(8)
axond.all_reduce(x)
if axond.get_rank() == 1:
    raise ValueError("bad batch shape (3, 5)")
axond.all_reduce(x)
"""

RECORDED_MAIN = """
import sys
import numpy as np
import axond


@axond.record
def main() -> None:
    axond.init_process_group("tcp", timeout=20)
    axond.all_reduce(np.ones(8))
    if axond.get_rank() == 1:
        raise ValueError("bad batch shape (3, 5)")
    axond.all_reduce(np.ones(8))


try:
    main()
except ValueError:
    sys.exit(3)  # the user's own handling: no traceback reaches sys.excepthook
"""


def _ranks(tmp_path: Path, source: str, debug: bool = False) -> list[Any]:
    (tmp_path / "axond_errors_probe.py").write_text(textwrap.dedent(source))
    envs = [{"PYTHONPATH": str(tmp_path), "AXOND_ERROR_FILE": str(tmp_path / f"error-{r}.json"),
             "AXOND_DEBUG": "1" if debug else "0"} for r in range(2)]
    return run_module_ranks("axond_errors_probe", 2, timeout=60.0, env=envs)


def _error_file(tmp_path: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / f"error-{rank}.json").read_text())
    assert set(data) == {"rank", "type", "message", "traceback", "time", "peer"}
    return data


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_survivor_prints_the_root_cause_in_one_short_traceback(tmp_path: Path) -> None:
    survivor, failing = _ranks(tmp_path, RANK_MAIN)
    assert failing.returncode == 1 and failing.stderr.strip().endswith("ValueError: bad batch shape (3, 5)")
    assert survivor.returncode == 1
    lines = survivor.stderr.strip().splitlines()
    assert lines[-1] == f"axond.errors.DistributedError: all_reduce on group 'world' (rank 0 of 2): {CAUSE}"
    assert [f for f in INTERNAL if f in survivor.stderr] == []
    assert "During handling" not in survivor.stderr and "direct cause" not in survivor.stderr
    assert "axond_errors_probe.py" in survivor.stderr  # the user's line is there
    assert len(lines) <= 15, survivor.stderr

    record = _error_file(tmp_path, 1)
    assert record["rank"] == 1 and record["type"] == "ValueError" and record["message"] == "bad batch shape (3, 5)"
    assert record["traceback"].rstrip().endswith("ValueError: bad batch shape (3, 5)")
    consequence = _error_file(tmp_path, 0)
    assert consequence["rank"] == 0 and consequence["type"] == "DistributedError" and CAUSE in consequence["message"]
    assert record["time"] <= consequence["time"]  # the worker reports the earliest as the root cause
    assert record["peer"] is None and consequence["peer"] == 1  # the rank each failed because of (axond.worker.blame)


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_axond_debug_keeps_the_transport_frames(tmp_path: Path) -> None:
    survivor = _ranks(tmp_path, RANK_MAIN, debug=True)[0]
    assert survivor.stderr.strip().splitlines()[-1].endswith(CAUSE)
    assert "framing.py" in survivor.stderr


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_record_reports_an_exception_the_program_handles_itself(tmp_path: Path) -> None:
    survivor, failing = _ranks(tmp_path, RECORDED_MAIN)
    assert failing.returncode == 3 and failing.stderr == ""
    assert _error_file(tmp_path, 1)["type"] == "ValueError"
    assert survivor.stderr.strip().splitlines()[-1].endswith(CAUSE)


def _frames(error: BaseException) -> list[str]:
    return [f.filename for f in traceback.extract_tb(error.__traceback__)]


def test_every_survivor_of_a_group_gets_the_root_cause() -> None:
    """Three thread ranks: rank 1 fails; rank 2 (waiting on it) and rank 0 (waiting on rank 2 in a large ring)
    both name rank 1's exception, and later calls on the aborted group still do."""
    groups = thread_groups(3, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> Any:
            if pg.rank == 1:
                abort_group(pg, ValueError("bad batch shape (3, 5)"))
                return None
            try:
                pg.all_reduce(np.ones(1_000_000))
            except DistributedError as e:
                return e
            return "no error"

        out = run_on(groups, body, timeout=20.0)
        for rank in (0, 2):
            e = out[rank]
            assert isinstance(e, DistributedError), e
            assert str(e) == f"all_reduce on group 'world' (rank {rank} of 3): {CAUSE}"
            assert e.root_cause == CAUSE and e.op == "all_reduce" and e.group == "world"
            assert e.__cause__ is None and e.__suppress_context__
            assert [f for f in _frames(e) if f.endswith(INTERNAL)] == []
        with pytest.raises(DistributedError, match="aborted by an earlier failure.*rank 1 failed: ValueError"):
            groups[0].barrier()
    finally:
        for g in groups:
            g.destroy()


def test_a_rank_blocked_sending_to_the_failed_rank_gets_the_root_cause() -> None:
    """Rank 0 is stuck writing a large message rank 1 never reads; rank 1 fails and leaves. The write fails
    (a reset connection), and rank 0 still finds rank 1's abort frame on the socket and names the cause."""
    groups = thread_groups(2, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> Any:
            if pg.rank == 1:
                time.sleep(0.3)
                abort_group(pg, ValueError("bad batch shape (3, 5)"))
                pg.destroy()
                return None
            try:
                for _ in range(20):
                    pg.send(np.ones(1_000_000), 1)
            except DistributedError as e:
                return e
            return "no error"

        e = run_on(groups, body, timeout=20.0)[0]
        assert isinstance(e, DistributedError), e
        assert str(e) == f"send on group 'world' (rank 0 of 2): {CAUSE}" and e.peer == 1
    finally:
        for g in groups:
            g.destroy()


def test_axond_debug_keeps_the_chain_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXOND_DEBUG", "1")
    groups = thread_groups(2, options=BackendOptions(timeout=10.0))
    try:
        def body(pg: ProcessGroup) -> Any:
            if pg.rank == 1:
                pg.destroy()  # a peer that leaves: the message names it, the chain keeps the socket error
                return None
            with pytest.raises(DistributedError, match="peer rank 1 closed the connection") as info:
                pg.all_reduce(np.ones(5))
            return info.value

        e = run_on(groups, body, timeout=20.0)[0]
        assert e.root_cause is None and e.__cause__ is not None
        assert any(f.endswith(INTERNAL) for f in _frames(e))
    finally:
        for g in groups:
            g.destroy()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_an_exception_before_init_process_group_still_writes_the_error_file(tmp_path: Path) -> None:
    (tmp_path / "axond_early_probe.py").write_text("import axond\n\nraise KeyError('no such dataset')\n")
    env = {"PYTHONPATH": str(tmp_path), "AXOND_ERROR_FILE": str(tmp_path / "error-0.json")}
    (only,) = run_module_ranks("axond_early_probe", 1, timeout=30.0, env=env)
    assert only.returncode == 1 and "KeyError" in only.stderr
    record = _error_file(tmp_path, 0)
    assert record["rank"] == 0 and record["type"] == "KeyError" and record["message"] == "'no such dataset'"
