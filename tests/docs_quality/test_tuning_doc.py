"""The policies are decision tables: every threshold is one docstring line that names its entry in
docs/design/tuning.md, and that page has an entry (machine, command, date) for each. The tcp backend's thresholds
live in its `policy` (the route) and `tuning` (how a path runs), the others in `axond.distributed.policy`; the
compiled helper's copies of them agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from axond.distributed import policy as generic_policy
from axond.distributed.backends.tcp import policy as tcp_policy

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "axond" / "distributed" / "backends" / "tcp" / "policy.py"
TUNING_TABLE = ROOT / "axond" / "distributed" / "backends" / "tcp" / "tuning.py"
"""How each tcp path runs once the policy chose it (re-exported by the policy)."""
GENERIC = ROOT / "axond" / "distributed" / "policy.py"
"""The thresholds used outside the tcp backend (host copies, the torch backend)."""
FASTBOX = ROOT / "axond" / "distributed" / "backends" / "tcp" / "shm" / "_fastbox.c"
MIRRORED = {"SLOW_DISTANCE": "HOST_COPY_SLOW_DISTANCE", "STRING_MIN": "STRING_MIN_BYTES",
            "BOUNCE_BYTES": "BOUNCE_BYTES", "BOUNCE_MIN": "BOUNCE_MIN_BYTES"}
"""#define of the compiled helper -> the policy constant it repeats (C cannot import it)."""
TABLES = (POLICY, TUNING_TABLE, GENERIC)
TUNING = ROOT / "docs" / "design" / "tuning.md"
NOT_THRESHOLDS = {"ORDERED_STORES", "ARENA_OPS", "LEADER_OPS"}
"""Module constants that are facts of the machine or lists of ops, not tuned values."""


def _constants() -> dict[str, str]:
    """Each upper-case constant of the three tables and its docstring."""
    body = [node for table in TABLES for node in ast.parse(table.read_text()).body]
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


def test_every_table_is_read() -> None:
    """The checks see each table: one constant of each is found."""
    assert {"MAILBOX_BYTES", "STEP_BYTES", "HOST_COPY_MIN_BYTES"} <= set(_constants())


def test_every_threshold_has_an_entry_with_what_it_decides_and_how_it_was_measured() -> None:
    page = TUNING.read_text()
    entries = dict(re.findall(r"^### (\w+)\n\n(.*?)(?=^### |^## |\Z)", page, flags=re.M | re.S))
    for name in set(_constants()) - NOT_THRESHOLDS:
        assert name in entries, f"docs/design/tuning.md has no entry for {name}"
        assert "**Decides:**" in entries[name] and "**Measured:**" in entries[name], name


def test_one_value_per_threshold() -> None:
    """No constant is in two tables, and each #define the compiled helper repeats equals its policy constant."""
    for i, table in enumerate(TABLES):
        for other in TABLES[i + 1:]:
            assert not _names(table) & _names(other), (table.name, other.name, _names(table) & _names(other))
    defines = {name: int(n) << int(shift or 0) for name, n, shift in
               re.findall(r"^#define (\w+) \(?([0-9]+)(?: << ([0-9]+))?\)?", FASTBOX.read_text(), flags=re.M)}
    for define, name in MIRRORED.items():
        value = getattr(tcp_policy, name, None) or getattr(generic_policy, name)
        assert defines[define] == value, (define, defines[define], name, value)


def _names(path: Path) -> set[str]:
    return {t.id for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()}
