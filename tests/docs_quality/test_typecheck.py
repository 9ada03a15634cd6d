"""mypy runs as a test: axond, coordinator and worker stay type-clean (settings in pyproject's [tool.mypy]).

`coordinator/` and `worker/` are installed as `axond.coordinator` and `axond.worker` (pyproject's package-dir), and
they import each other by those names. mypy cannot follow that mapping: given the directories as they lie, it would
take every `axond.coordinator.*` import for a missing module (Any) and check nothing across them. So mypy runs on a
tree of links laid out as installed (`.mypy_cache/installed/axond/`, rebuilt each run), and its messages are
mapped back to the files' own paths. `python tests/docs_quality/test_typecheck.py` runs the same check by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / ".mypy_cache" / "installed"
MOUNTS = {"coordinator": "coordinator", "worker": "worker"}
"""axond.<name> -> the directory installed under that name (pyproject's package-dir)."""


def installed_tree() -> Path:
    """Lay out `TREE/axond` as installed: a link per entry of axond/, and coordinator/ and worker/ beside them."""
    package = TREE / "axond"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {entry.name: entry for entry in (ROOT / "axond").iterdir() if entry.name != "__pycache__"}
    wanted.update({name: ROOT / where for name, where in MOUNTS.items()})
    for link in package.iterdir():
        if link.name not in wanted or not link.is_symlink() or Path(os.readlink(link)) != wanted[link.name]:
            link.unlink()
    for name, target in wanted.items():
        if not (package / name).is_symlink():
            (package / name).symlink_to(target)
    return package


def own_paths(text: str) -> str:
    """mypy's messages with the linked paths written as the files' own (coordinator/x.py, not
    .mypy_cache/installed/axond/coordinator/x.py)."""
    prefix = str(installed_tree().relative_to(ROOT)) + "/"
    for name, where in MOUNTS.items():
        text = text.replace(f"{prefix}{name}/", f"{where}/")
    return text.replace(prefix, "axond/")


def run_mypy(probe: str | None = None) -> subprocess.CompletedProcess[str]:
    """mypy over the installed tree; `probe`, if given, is checked as one more module, `axond._typecheck_probe`."""
    package = installed_tree()
    if probe is not None:
        (package / "_typecheck_probe.py").write_text(probe)
    done = subprocess.run([sys.executable, "-m", "mypy", str(package.relative_to(ROOT))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return subprocess.CompletedProcess(done.args, done.returncode, own_paths(done.stdout), own_paths(done.stderr))


def test_mypy_is_clean() -> None:
    """mypy reports nothing on axond, coordinator and worker (its cache, .mypy_cache, makes reruns take seconds)."""
    done = run_mypy()
    assert done.returncode == 0, ("mypy found problems (run `python tests/docs_quality/test_typecheck.py`):\n"
                                  f"{done.stdout[-6000:]}")


def test_the_coordinator_is_checked_under_its_installed_name() -> None:
    """A type error in one coordinator module, seen only through another's import, is reported: mypy follows
    `axond.coordinator.*` imports instead of taking them for missing modules."""
    try:
        done = run_mypy("from axond.coordinator.limits import CoordinatorLimits\n\n"
                        "NODES: str = CoordinatorLimits().max_nodes\n")
    finally:
        (TREE / "axond" / "_typecheck_probe.py").unlink(missing_ok=True)
    assert "axond/_typecheck_probe.py:3: error: Incompatible types in assignment" in done.stdout, done.stdout[-3000:]


if __name__ == "__main__":
    finished = run_mypy()
    sys.stdout.write(finished.stdout + finished.stderr)
    sys.exit(finished.returncode)
