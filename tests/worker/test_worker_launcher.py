"""The local-rank launcher: real processes, output prefixing, failure detection and tree kills."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from axond.testing.waits import KILL_WAIT, wait_until
from axond.worker.launcher import LocalRanks, RankSpec, exit_code_of, start_ranks


class Collector:
    """An OutputSink that keeps every line."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            self.lines.append((rank, stream, text))

    def of(self, rank: int, stream: str) -> list[str]:
        with self._lock:
            return [t for r, s, t in self.lines if r == rank and s == stream]


def specs(n: int, offset: int = 0) -> list[RankSpec]:
    return [
        RankSpec(rank=offset + i, local_rank=i, env=dict(os.environ, MY_RANK=str(offset + i), PYTHONUNBUFFERED="1"))
        for i in range(n)
    ]


@pytest.fixture
def started() -> Iterator[list[LocalRanks]]:
    """Collects started rank groups and always stops them."""
    groups: list[LocalRanks] = []
    yield groups
    for g in groups:
        g.stop(grace=0.5)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_all_ranks_succeed_and_output_is_prefixed_per_stream(started: list[LocalRanks]) -> None:
    out = Collector()
    code = "import os,sys; r=os.environ['MY_RANK']; print('out', r); print('err', r, file=sys.stderr); print('two')"
    ranks = start_ranks([sys.executable, "-c", code], specs(3, offset=4), sink=out)
    started.append(ranks)
    result = ranks.wait(timeout=30)
    assert result is not None and result.ok
    assert sorted(e.rank for e in result.exits) == [4, 5, 6]
    ranks.join_readers(timeout=5)
    for r in (4, 5, 6):
        assert out.of(r, "stdout") == [f"out {r}", "two"]
        assert out.of(r, "stderr") == [f"err {r}"]


def test_first_failure_is_reported_and_others_keep_running_until_stopped(started: list[LocalRanks]) -> None:
    code = "import os,sys,time; r=int(os.environ['MY_RANK']); time.sleep(0.2) if r==1 else time.sleep(60); sys.exit(7)"
    ranks = start_ranks([sys.executable, "-c", code], specs(3), sink=Collector())
    started.append(ranks)
    result = ranks.wait(timeout=30)
    assert result is not None and not result.ok
    assert result.first_failure is not None
    assert (result.first_failure.rank, result.first_failure.exit_code) == (1, 7)
    assert re.fullmatch(r"rank 1 \(\S+, pid \d+\) exited with code 7", result.first_failure.describe())
    assert all(alive(pid) for i, pid in enumerate(ranks.pids) if i != 1)
    t0 = time.monotonic()
    ranks.stop(grace=5)
    assert time.monotonic() - t0 < 5, "SIGTERM should end a sleeping python at once"
    assert not any(alive(pid) for pid in ranks.pids)


def test_stop_kills_the_whole_tree_and_escalates_to_sigkill(started: list[LocalRanks]) -> None:
    out = Collector()
    code = (
        "import signal,subprocess,sys,time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import signal,time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print('child', c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    ranks = start_ranks([sys.executable, "-c", code], specs(1), sink=out)
    started.append(ranks)
    deadline = time.monotonic() + 20
    while not out.of(0, "stdout") and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(out.of(0, "stdout")[0].split()[1])
    assert alive(child)
    t0 = time.monotonic()
    ranks.stop(grace=0.5)
    elapsed = time.monotonic() - t0
    assert 0.4 < elapsed < 5, elapsed
    wait_until(lambda: not alive(ranks.pids[0]) and not alive(child), KILL_WAIT, "the rank and its child gone")
    result = ranks.poll()
    assert result is not None and result.first_failure is not None
    assert result.first_failure.exit_code == 128 + 9
    assert "SIGKILL" in result.first_failure.describe()


def test_missing_command_is_a_failed_rank_with_code_127(started: list[LocalRanks]) -> None:
    ranks = start_ranks(["/nonexistent/axond-no-such-binary"], specs(2), sink=Collector())
    started.append(ranks)
    result = ranks.wait(timeout=5)
    assert result is not None and result.first_failure is not None
    assert result.first_failure.exit_code == 127
    assert "cannot start" in result.first_failure.describe()


def test_a_python_script_given_without_python_gets_a_hint(started: list[LocalRanks], tmp_path: Path) -> None:
    """`axond worker ... -- train.py --lr 1`: the script is no executable on PATH; the failure says what was meant."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    ranks = start_ranks(["train.py", "--lr", "1"], specs(1), sink=Collector(), cwd=str(tmp_path))
    started.append(ranks)
    result = ranks.wait(timeout=5)
    assert result is not None and result.first_failure is not None and result.first_failure.exit_code == 127
    assert "did you mean `python train.py --lr 1`?" in result.first_failure.describe()
    other = start_ranks(["no-such-tool-axond"], specs(1), sink=Collector())
    started.append(other)
    result = other.wait(timeout=5)
    assert result is not None and result.first_failure is not None and "did you mean" not in result.first_failure.describe()


def test_wait_times_out_while_ranks_run(started: list[LocalRanks]) -> None:
    ranks = start_ranks([sys.executable, "-c", "import time; time.sleep(60)"], specs(1), sink=Collector())
    started.append(ranks)
    t0 = time.monotonic()
    assert ranks.wait(timeout=0.3) is None
    assert time.monotonic() - t0 < 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="after `--`"):
        start_ranks([], specs(1))
    with pytest.raises(ValueError, match="nproc-per-node"):
        start_ranks([sys.executable], [])


def test_exit_code_of_signals() -> None:
    assert exit_code_of(0) == 0
    assert exit_code_of(3) == 3
    assert exit_code_of(-15) == 143


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_ranks_do_not_outlive_a_killed_worker() -> None:
    """SIGKILL the process that started the ranks: each rank gets SIGTERM from the kernel (PR_SET_PDEATHSIG,
    armed by rank_exec.py before the exec) instead of running on as an orphan."""
    import signal
    import subprocess

    worker_code = (
        "import os, sys, time\n"
        "from axond.worker.launcher import RankSpec, start_ranks\n"
        "ranks = start_ranks([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
        "                    [RankSpec(rank=i, local_rank=i, env=dict(os.environ)) for i in range(2)], sink=lambda *a: None)\n"
        "time.sleep(0.5)\n"
        "print(' '.join(map(str, ranks.pids)), flush=True)\n"
        "time.sleep(120)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", worker_code], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        pids = [int(p) for p in worker.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a rank outlived its SIGKILLed worker"
    finally:
        worker.kill()
        worker.wait(timeout=10)


def test_rank_exec_reports_a_command_it_cannot_start() -> None:
    """The shim's own failure path (the launcher normally catches a missing command before starting it)."""
    import subprocess

    from axond.worker.launcher import RANK_EXEC

    proc = subprocess.run([sys.executable, "-S", RANK_EXEC, str(os.getpid()), "--", "/nonexistent/cmd"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 127 and "cannot start '/nonexistent/cmd'" in proc.stderr
    usage = subprocess.run([sys.executable, "-S", RANK_EXEC, "x"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage" in usage.stderr
