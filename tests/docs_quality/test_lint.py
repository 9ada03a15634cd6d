"""ruff runs as a test: the tree passes the rules of pyproject's [tool.ruff], and every `noqa` names a rule it runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    """How to run ruff here: the installed module (`pip install -e '.[dev]'` brings it), else the command."""
    done = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, timeout=60)
    if done.returncode == 0:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    assert found is not None, "ruff is not installed: pip install -e '.[dev]'"
    return [found]


def test_ruff_is_clean() -> None:
    """`ruff check .` reports nothing, RUF100 included: a `noqa` whose rule is not selected, or that silences
    nothing, fails too."""
    done = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    report = done.stdout[-6000:] + done.stderr[-1000:]
    assert done.returncode == 0, f"ruff found problems (run `ruff check .`):\n{report}"


def test_ruff_catches_what_it_should(tmp_path: Path) -> None:
    """The configuration is live: an unused import in a new file under axond/ is reported (ruff reads the project's
    settings for a path inside it, so the file is checked as if it were there)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n")
    done = subprocess.run([*_ruff(), "check", "--no-cache", "--stdin-filename", "axond/_lint_probe.py", "-"],
                          cwd=ROOT, input=probe.read_text(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout + done.stderr
