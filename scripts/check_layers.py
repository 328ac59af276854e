#!/usr/bin/env python
"""Fail when a module imports a stage above its own: the data's journey points one way.

Layers, lowest first (a unit may import any unit on a lower layer, and
itself; two units on the same layer may not import each other)::

    core
    table
    ingest, columns
    explore, export, download
    skips
    stream
    train
    pipelines                  (Ray Data job graphs)
    cli                        (``prx_data.cli.*``: argument parsing over the library)
    shims                      (``python -m prx_data.<job>`` modules and ``__main__``)

Every import counts, including those inside functions. ``prx_data/__init__.py``
(lazy public API) is exempt. Usage: ``python scripts/check_layers.py [ROOT]``;
exit 1 with one line per violation.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("table",),
    ("ingest", "columns"),
    ("explore", "export", "download"),
    ("skips",),
    ("stream",),
    ("train",),
    ("pipelines",),
    ("cli",),
    ("shims",),
]
LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}
PACKAGES = ("prx_data", "pipelines")


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.importer} (layer {LEVEL[self.importer]}) imports "
            f"{self.imported} (layer {LEVEL[self.imported]}): dependencies must point down "
            "core -> table -> ingest/columns -> explore/export/download -> skips -> stream -> train "
            "-> pipelines -> cli -> shims"
        )


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def unit_of(module: str) -> str | None:
    """The layering unit of a dotted module name, or None when it is not ours / exempt."""
    parts = module.split(".")
    if parts[0] == "pipelines":
        return "pipelines"
    if parts[0] != "prx_data" or len(parts) == 1:
        return None
    if parts[-1] == "__main__":
        return "shims"
    if parts[1] in LEVEL:
        return parts[1]
    return "shims" if len(parts) == 2 else None


def imports_of(tree: ast.AST, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # ``from prx_data import table`` names a module: judge the submodule.
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            found.append((node.lineno, base))
    return found


def check(root: str | Path) -> list[Violation]:
    root = Path(root)
    out: list[Violation] = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(root, path)
            importer = unit_of(module)
            if importer is None:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            seen: set[tuple[int, str]] = set()
            for line, target in imports_of(tree, module, path.name == "__init__.py"):
                imported = unit_of(target)
                if imported is None or imported == importer or (line, imported) in seen:
                    continue
                seen.add((line, imported))
                if LEVEL[imported] >= LEVEL[importer]:
                    out.append(Violation(str(path.relative_to(root)), line, importer, imported))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    violations = check(root)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} layering violation(s)", file=sys.stderr)
        return 1
    print("layering: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
