"""The documentation: the MkDocs site builds strictly, every command in the README runs on a fresh install,
the README's links resolve, its walkthrough is the real example script, and every AXOND_* variable is documented."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SETUP_COMMANDS = ["pip install -e '.[dev]'", "pytest"]
"""The README's one set-up block: install, then test. It is the only bash block not run here (.ci/run runs it)."""
BLOCK_TIMEOUT = 100.0
"""Seconds one README block may take as a whole (the Quick start trains for one epoch: a few seconds)."""
LEFTOVER_GRACE = 15.0
"""Seconds a block's processes get to exit after its shell did (a stopping coordinator drains for 1 s)."""
QUIET_S = 0.5
"""Seconds no process of a block may be seen before the block counts as stopped."""
MARK = "DOCS_TEST_MARK"
"""Environment variable every process a block starts inherits, so leftovers are found even in their own sessions."""


def fenced_blocks(text: str, lang: str) -> list[str]:
    """Contents of the ```lang fenced blocks of a Markdown text, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def readme_bash_blocks() -> tuple[list[str], list[str]]:
    """(set-up blocks, blocks to run): a block is set-up when it installs the package (`pip install -e`)."""
    blocks = fenced_blocks(README.read_text(), "bash")
    setup = [b for b in blocks if "pip install -e" in b]
    return setup, [b for b in blocks if b not in setup]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def marked_processes(mark: str) -> dict[int, str]:
    """Live processes whose environment carries `MARK=mark`, with their command lines."""
    needle = f"{MARK}={mark}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone, or not ours to read
    return found


@dataclass
class BlockRun:
    """What running one block left behind."""

    mark: str
    """The value of MARK in the block's processes."""
    returncode: int | None
    """The shell's exit code; None if it ran past the timeout (it is then killed)."""
    output: str
    leftovers: dict[int, str]
    """Processes of the block still alive LEFTOVER_GRACE seconds after the shell exited (killed since)."""


def run_block(block: str, tmp: Path, timeout: float = BLOCK_TIMEOUT, grace: float = LEFTOVER_GRACE) -> BlockRun:
    """Run `block` with `bash -c` as a fresh install would: empty HOME and XDG_STATE_HOME, no AXOND_* settings,
    a scratch working directory, and a free port in place of 29500. Kills whatever it leaves running."""
    mark = uuid.uuid4().hex
    home, state, work = tmp / "home", tmp / "state", tmp / "work"
    for d in (home, state, work):
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AXOND_")}
    env.update(HOME=str(home), XDG_STATE_HOME=str(state), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               **{MARK: mark})
    script = block.replace("29500", str(free_port()))
    log = tmp / "output.log"
    with log.open("wb") as out:  # a file, not a pipe: a process left behind must not hold the harness up
        proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            returncode = None
    # One empty scan proves nothing (a process in the middle of exec shows no environment for a moment):
    # the block is done when no process of it has been seen for QUIET_S, or the grace ran out.
    deadline = time.monotonic() + grace
    leftovers = marked_processes(mark)
    quiet_since = None if leftovers else time.monotonic()
    while time.monotonic() < deadline and (quiet_since is None or time.monotonic() - quiet_since < QUIET_S):
        time.sleep(0.1)
        leftovers = marked_processes(mark)
        if leftovers:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
    deadline = time.monotonic() + 5.0
    while (alive := marked_processes(mark)) and time.monotonic() < deadline:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return BlockRun(mark, returncode, log.read_text(errors="replace"), leftovers)


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: keep it under 12 KB and move detail to docs/"


def test_readme_setup_is_install_then_test() -> None:
    setup, _ = readme_bash_blocks()
    assert len(setup) == 1, f"the README must have one set-up block (install, test), found {len(setup)}"
    assert setup[0].strip().splitlines() == SETUP_COMMANDS


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_mkdocs_site_builds_strictly(tmp_path: Path) -> None:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{module} is not installed: run `pip install -e '.[dev]'` (the dev extra has mkdocs and mkdocs-material)")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").is_file() and (site / "design" / "index.html").is_file()


@pytest.mark.timeout(BLOCK_TIMEOUT + LEFTOVER_GRACE + 30)
@pytest.mark.slow
@pytest.mark.parametrize("block", readme_bash_blocks()[1],
                         ids=[f"{i}:{b.strip().splitlines()[0][:50]}" for i, b in enumerate(readme_bash_blocks()[1])])
def test_readme_block_runs_on_a_fresh_install(block: str, tmp_path: Path) -> None:
    run = run_block(block, tmp_path)
    assert run.returncode is not None, f"the block ran over {BLOCK_TIMEOUT} s:\n{block}\noutput:\n{run.output}"
    assert run.returncode == 0, f"the block exited {run.returncode}:\n{block}\noutput:\n{run.output}"
    assert not run.leftovers, f"the block left processes running: {run.leftovers}\noutput:\n{run.output}"


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT + LEFTOVER_GRACE + 30)
def test_block_harness_runs_a_cluster_and_sees_it_stop(tmp_path: Path) -> None:
    """A block in the Quick start's shape (a background coordinator, a worker, cleanup) passes the harness."""
    block = (
        "axond coordinator --port 29500 & coordinator=$!\n"
        "until axond health --coordinator 127.0.0.1:29500 2>/dev/null; do sleep 0.2; done\n"
        "axond worker --coordinator 127.0.0.1:29500 --nproc-per-node 2 -- python -m axond.examples.hello\n"
        "status=$?; kill $coordinator; wait $coordinator; exit $status\n"
    )
    run = run_block(block, tmp_path)
    assert run.returncode == 0, run.output
    assert "hello from rank 1 of 2" in run.output and not run.leftovers


@pytest.mark.slow
def test_block_harness_reports_failures_and_leftovers(tmp_path: Path) -> None:
    """The harness can fail: an exit code is passed on, and a process left behind is found and killed."""
    assert run_block("exit 3", tmp_path / "a").returncode == 3
    run = run_block("setsid sleep 300 &\nexit 0", tmp_path / "b", grace=1.0)
    assert run.returncode == 0
    assert any("sleep 300" in cmd for cmd in run.leftovers.values()), run.leftovers
    assert not marked_processes(run.mark), "the harness did not kill what the block left behind"
    assert run_block("sleep 30", tmp_path / "c", timeout=1.0).returncode is None


def test_readme_links_resolve() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local), "the README should link to the docs/ pages"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_walkthrough_is_the_example_script() -> None:
    """The README shows axond/examples/my_first_script.py as it is, so what readers copy is what the test runs."""
    section = README.read_text().split("## Your own training script", 1)[1]
    shown = fenced_blocks(section, "python")[0]
    script = (ROOT / "axond" / "examples" / "my_first_script.py").read_text()
    assert shown in script, "README's walkthrough differs from axond/examples/my_first_script.py: copy the file's body"
    assert "python -m axond.examples.my_first_script" in section


def test_every_axond_variable_is_documented() -> None:
    """Every AXOND_* name the code reads or sets has a row in docs/environment.md."""
    page = (ROOT / "docs" / "environment.md").read_text()
    names: set[str] = set()
    for package in ("axond", "coordinator", "worker"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(n for n in re.findall(r"\bAXOND_[A-Z0-9_]+", path.read_text()) if not n.endswith("_"))
    undocumented = sorted(n for n in names if f"`{n}`" not in page)
    assert not undocumented, f"add these variables to docs/environment.md: {undocumented}"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_first_script_trains_on_two_ranks(tmp_path: Path) -> None:
    """The walkthrough's script runs as two real ranks (a file store instead of a coordinator) and learns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AXOND_")}
    env.update(AXOND_FILE_STORE=str(tmp_path / "store"), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "axond.examples.my_first_script"], cwd=tmp_path,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], outputs
    losses = [float(v) for v in re.findall(r"^epoch \d+/3 loss ([0-9.]+)$", outputs[0], flags=re.M)]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], outputs[0]
    assert "epoch" not in outputs[1], "only rank 0 prints"
