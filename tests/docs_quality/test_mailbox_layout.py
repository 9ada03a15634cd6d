"""The mailbox's slot layout has one definition (`mailbox.LAYOUT`); the compiled helper's `#define`s equal it offset by
offset, in its source and in the module built from it; its wait tuning comes from the policy table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from axond.distributed.backends.tcp import policy
from axond.distributed.backends.tcp.shm import mailbox

ROOT = Path(__file__).resolve().parents[2]
FASTBOX = ROOT / "axond" / "distributed" / "backends" / "tcp" / "shm" / "_fastbox.c"


def _defines() -> dict[str, int]:
    """The layout `#define`s of `_fastbox.c`, their expressions evaluated over the ones before them."""
    found: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (\w+_(?:OFF|BYTES)) ([^/\n]+)", FASTBOX.read_text(), flags=re.M):
        if re.fullmatch(r"[\w\s()+*<>]+", expr):
            found[name] = int(eval(expr, {"__builtins__": {}}, dict(found)))  # integers and the names above
    return found


def test_the_c_source_has_the_python_layout_offset_by_offset() -> None:
    defines = _defines()
    for name, offset in mailbox.LAYOUT.items():
        assert defines.get(name) == offset, f"_fastbox.c #define {name} is {defines.get(name)}, mailbox.LAYOUT {offset}"


def test_the_built_helper_has_the_python_layout() -> None:
    fastbox = pytest.importorskip("axond.distributed.backends.tcp.shm._fastbox", reason="built only with a C compiler")
    assert fastbox.LAYOUT == mailbox.LAYOUT


def test_the_layout_reader_finds_every_offset() -> None:
    """The source check is not vacuous: every offset is found, and one moved word would be told apart."""
    defines = _defines()
    assert set(mailbox.LAYOUT) <= set(defines)
    assert defines["SEQ_OFF"] == defines["HEAD_OFF"] + 8 * mailbox.SEQ_FIELD


def test_the_compiled_waits_take_their_tuning_from_the_policy() -> None:
    """No wait constant is left as a #define of the compiled helper: the policy passes them to `_fastbox.Box`."""
    source = FASTBOX.read_text()
    for name in ("PROBE_FIRST", "HOME_EVERY", "MOVE_EVERY"):
        assert not re.search(rf"^#define {name}\b", source, flags=re.M), name
    assert policy.MAILBOX_PROBE_FIRST_OPS <= policy.MAILBOX_PROBE_OPS
    text = Path(mailbox.__file__).read_text()
    for name in ("MAILBOX_PROBE_FIRST_OPS", "MAILBOX_HOME_EVERY_OPS", "MAILBOX_MOVE_EVERY_OPS"):
        assert name in text, f"mailbox.py does not pass {name} to the compiled helper"
