"""The suite's layout: every test module in the folder tests/place_tests.py names for it, helpers in tests/helpers/
only, no two test modules with one basename (pytest imports them by basename)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from place_tests import STAY, destination  # noqa: E402


def test_every_module_is_where_the_rules_place_it() -> None:
    misplaced = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel in STAY or "__pycache__" in rel:
            continue
        if rel != destination(path.name) and not (rel.startswith("helpers/") and not path.name.startswith("test_")):
            misplaced.append(f"{rel} (belongs in tests/{destination(path.name)})")
    assert not misplaced, "run `python tests/place_tests.py --apply`, or add a rule to it:\n" + "\n".join(misplaced)


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], [n for n, k in names.items() if k > 1]
