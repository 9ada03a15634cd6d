"""mypy runs as a test: axond, coordinator and worker stay type-clean (settings in pyproject's [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_is_clean() -> None:
    """`mypy axond coordinator worker` reports nothing (its cache, .mypy_cache, makes reruns take seconds)."""
    done = subprocess.run([sys.executable, "-m", "mypy", "axond", "coordinator", "worker"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mypy found problems (run `mypy axond coordinator worker`):\n{done.stdout[-6000:]}"
