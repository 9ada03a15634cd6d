"""docs/design/layout.md maps every area: each top-level folder of the repository, each package and module of
`axond/`, each module and package of `axond/distributed/`, `coordinator/` and `worker/` is named on it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "design" / "layout.md"
AREAS = ("axond", "coordinator", "worker", "proto", "docker", "tests", "bench", "docs")
"""The top-level layout the project was specified with, and where its benchmarks and docs live."""
MAPPED = ("axond", "axond/distributed", "coordinator", "worker")
"""Folders whose every module and package the page names."""


def _entries(folder: Path) -> list[str]:
    """The modules (`name.py`) and packages (`name/`) of `folder`, as the page writes them."""
    return sorted(f"{p.name}/" if p.is_dir() else p.name for p in folder.iterdir()
                  if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py"))


def test_the_layout_page_names_every_area_and_module() -> None:
    text = LAYOUT.read_text()
    missing = [f"{area}/" for area in AREAS if f"`{area}/`" not in text]
    for folder in MAPPED:
        missing += [f"{folder}/{name}" for name in _entries(ROOT / folder)
                    if f"`{name}`" not in text and f"`{name.rstrip('/')}`" not in text
                    and f"`{name.removesuffix('.py')}`" not in text]
    assert not missing, f"docs/design/layout.md does not name: {missing}"


def test_the_scanner_finds_the_packages() -> None:
    assert "distributed/" in _entries(ROOT / "axond") and "config.py" in _entries(ROOT / "axond")
    assert "state/" in _entries(ROOT / "coordinator") and "fast_path.py" in _entries(ROOT / "axond" / "distributed")
