"""The tcp policy is a decision table: every threshold is one docstring line that names its entry in
docs/design/tuning.md, and that page has an entry (machine, command, date) for each."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "axond" / "distributed" / "backends" / "tcp" / "policy.py"
TUNING = ROOT / "docs" / "design" / "tuning.md"
NOT_THRESHOLDS = {"ORDERED_STORES", "ARENA_OPS", "LEADER_OPS"}
"""Module constants that are facts of the machine or lists of ops, not tuned values."""


def _constants() -> dict[str, str]:
    """Each upper-case constant of policy.py and its docstring."""
    body = ast.parse(POLICY.read_text()).body
    found = {}
    for node, after in zip(body, [*body[1:], None]):
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id.isupper():
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            found[target.id] = str(doc)
    return found


def test_every_threshold_is_one_line_naming_its_entry() -> None:
    for name, doc in _constants().items():
        if name in NOT_THRESHOLDS:
            continue
        assert doc.endswith(f"(#{name.lower()}).") and len(doc) < 240, (name, doc)


def test_every_threshold_has_an_entry_with_what_it_decides_and_how_it_was_measured() -> None:
    page = TUNING.read_text()
    entries = dict(re.findall(r"^### (\w+)\n\n(.*?)(?=^### |^## |\Z)", page, flags=re.M | re.S))
    for name in set(_constants()) - NOT_THRESHOLDS:
        assert name in entries, f"docs/design/tuning.md has no entry for {name}"
        assert "**Decides:**" in entries[name] and "**Measured:**" in entries[name], name
