"""A rank's Flight Recorder dump on a hang (AXOND_FR_DUMP_DIR): written once per hang, where torch's analyzer finds the
rank in the name, and at the documented threshold (tests/cli/test_cli_status_stacks.py runs it in a real torch job)."""

from __future__ import annotations

import pickle
import types
from pathlib import Path

import pytest

from axond.distributed.diagnostics.flight_recorder import FILE_PREFIX, HangDumps
from axond.distributed.diagnostics.inflight import hang_after, report_after


def _group(op: str | None, finished: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(name="0", ranks=[0, 1], inflight=op, inflight_seq=finished + 1,
                                 waited_ops=finished, timeout=40.0)


def test_a_hang_is_written_once_and_the_next_hang_again(tmp_path: Path) -> None:
    dumps = HangDumps(str(tmp_path / "fr"))  # made when first written
    g = _group("all_reduce", 1)
    assert dumps.check(3, [g], frozenset()) is None and not (tmp_path / "fr").exists()
    path = dumps.check(3, [g], frozenset({(id(g), 2)}))
    assert path == str(tmp_path / "fr" / f"{FILE_PREFIX}3")
    dump = pickle.loads(Path(path).read_bytes())
    assert dump["pg_config"]["0"]["ranks"] == "[0, 1]"
    assert [(e["collective_seq_id"], e["profiling_name"]) for e in dump["entries"]] == [(2, "gloo:all_reduce")]
    assert sorted(p.name for p in (tmp_path / "fr").iterdir()) == [f"{FILE_PREFIX}3"]  # nothing else for the analyzer
    Path(path).unlink()
    assert dumps.check(3, [g], frozenset({(id(g), 2)})) is None  # the same hang, looked at again
    assert dumps.check(3, [g], frozenset({(id(g), 2), (id(g) + 1, 7)})) is None  # it grows: still the same hang
    assert dumps.check(5, [g], frozenset({(id(g), 2)})) is not None  # another rank of the process: its own file
    assert dumps.check(3, [g], frozenset()) is None  # it ended
    g.waited_ops, g.inflight_seq = 4, 5
    assert dumps.check(3, [g], frozenset({(id(g), 5)})) == path  # a new hang
    assert [e["collective_seq_id"] for e in pickle.loads(Path(path).read_bytes())["entries"]] == [5]


def test_a_directory_that_cannot_be_written_is_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    dumps = HangDumps(str(tmp_path / "file" / "fr"))
    g = _group("broadcast", 0)
    assert dumps.check(0, [g], frozenset({(id(g), 1)})) is None
    assert dumps.check(0, [g], frozenset()) is None
    assert dumps.check(0, [g], frozenset({(id(g), 2)})) is None
    err = capsys.readouterr().err
    assert err.count("cannot write its Flight Recorder dump to AXOND_FR_DUMP_DIR=") == 1, err


def test_the_dump_comes_with_the_workers_first_notice_and_before_the_op_fails() -> None:
    assert hang_after(40.0, 2.0) == report_after(40.0) == 10.0  # the rank reports the op only after 10 s
    assert hang_after(100.0, 20.0) == 20.0  # the worker's first "still waiting" notice
    assert hang_after(100.0, 0.0) == report_after(100.0)  # notices off: when the rank reports it
    assert hang_after(30.0, 60.0) == 15.0  # a notice interval longer than the timeout: half the timeout
