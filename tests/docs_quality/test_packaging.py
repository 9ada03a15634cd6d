"""The wheel holds every package of the tree: pyproject.toml lists each directory with an __init__.py (an
editable install finds unlisted ones anyway, so only this test notices one missing from a real install)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setuptools["packages"]), setuptools["package-dir"]
    roots = {(ROOT / where).resolve() for where in dirs.values()}
    found = set()
    for name, where in dirs.items():
        for init in (ROOT / where).rglob("__init__.py"):
            inside = [parent for parent in init.parents if parent.resolve() in roots]
            if inside[0].resolve() != (ROOT / where).resolve():
                continue  # a directory mapped to a package of its own (e.g. axond_torch_autoload)
            rel = init.parent.relative_to(ROOT / where).parts
            found.add(".".join((name, *rel)))
    assert sorted(found - listed) == [], "add these to [tool.setuptools] packages in pyproject.toml"
    assert sorted(listed - found) == [], "pyproject.toml lists packages that do not exist"
