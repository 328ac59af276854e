"""docs/ARCHITECTURE.md's module map matches the tree: every package exists, every module is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _map_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        pkg = cells[0].strip("`")
        if pkg.endswith("/") and "<" not in pkg:
            rows.append((pkg, cells[-1]))
    return rows


def test_every_package_of_the_map_exists_and_names_each_of_its_modules():
    rows = _map_rows()
    assert {"prx_data/core/", "prx_data/export/", "pipelines/", "prx_data/cli/"} <= {
        p for p, _ in rows
    }
    for pkg, owns in rows:
        folder = ROOT / pkg
        assert (folder / "__init__.py").is_file(), f"the map names {pkg}, which is no package"
        if pkg == "prx_data/cli/":
            continue  # one module per job: checked against the job table in test_cli_help
        named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", owns))
        modules = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
        assert not modules - named, (
            f"{pkg}: modules missing from the map: {sorted(modules - named)}"
        )


def test_every_package_of_the_tree_is_in_the_map():
    mapped = {p for p, _ in _map_rows()}
    packages = {
        f"{p.parent.relative_to(ROOT).as_posix()}/"
        for p in [*(ROOT / "prx_data").glob("*/__init__.py"), ROOT / "pipelines" / "__init__.py"]
    }
    assert not packages - mapped, (
        f"packages missing from the module map: {sorted(packages - mapped)}"
    )
