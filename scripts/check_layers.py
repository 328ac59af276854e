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
    pipelines                  (``prx_data.pipelines``: the Ray Data job graphs, kept in the
                                top-level ``pipelines/`` folder; its folder name is refused)
    cli                        (``prx_data.cli.*``: argument parsing over the library)
    shims                      (``python -m prx_data.<job>`` modules and ``__main__``)

Every import counts, including those inside functions and under
``if TYPE_CHECKING:``. ``prx_data/__init__.py`` (lazy public API) is exempt.

It also fails on any import circle between the library's modules, inside a
unit too: a circle closed by a lazy or type-only import still means neither
module can be read, tested or moved without the other. ``from pkg import x``
depends on ``pkg.x`` when that is a module, else on ``pkg`` itself.

Usage: ``python scripts/check_layers.py [ROOT]``; exit 1 with one line per
violation and per circle.
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


@dataclass(frozen=True)
class TopLevelName:
    """An import of the job graphs by the folder's name instead of ``prx_data.pipelines``."""

    path: str
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: imports {self.imported!r} by its folder name: the jobs "
            "install as prx_data.pipelines (import prx_data.pipelines.<job>)"
        )


def module_name(root: Path, path: Path) -> str:
    """The dotted name a file imports as; the top-level ``pipelines/`` is ``prx_data.pipelines``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts and parts[0] == "pipelines":
        parts = ["prx_data", *parts]
    return ".".join(parts)


def unit_of(module: str) -> str | None:
    """The layering unit of a dotted module name, or None when it is not ours / exempt."""
    parts = module.split(".")
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
            base = _absolute(node, module, is_pkg)
            # ``from prx_data import table`` names a module: judge the submodule.
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            found.append((node.lineno, base))
    return found


@dataclass(frozen=True)
class Circle:
    """Modules that import each other in a loop: ``path[0] -> path[1] -> ... -> path[0]``."""

    #: Every module of the strongly connected group (each reaches every other).
    modules: tuple[str, ...]
    path: tuple[str, ...]
    #: (file, line) of each import along the loop, in ``path`` order.
    where: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        hops = " -> ".join((*self.path, self.path[0]))
        lines = ", ".join(f"{f}:{n}" for f, n in self.where)
        group = f"{len(self.modules)} modules import each other ({', '.join(self.modules)})"
        return (
            f"import circle: {group}; one loop: {hops} (at {lines}): "
            "move what they share into a module below them"
        )


def _sources(root: Path) -> dict[str, Path]:
    """Every module of the library by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    return {
        module_name(root, path): path
        for pkg in PACKAGES
        for path in sorted((root / pkg).rglob("*.py"))
    }


def module_graph(root: str | Path) -> dict[str, dict[str, tuple[str, int]]]:
    """Importer -> {imported module: (file, line) of its first import} over the library."""
    root = Path(root)
    sources = _sources(root)

    def owner(name: str) -> str | None:  # ``a.b.name`` -> the module that defines it
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for module, path in sources.items():
        where = str(path.relative_to(root))
        edges: dict[str, tuple[str, int]] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                targets = [owner(f"{base}.{a.name}") for a in node.names]
            else:
                continue
            for t in targets:
                if t is not None and t != module:
                    edges.setdefault(t, (where, node.lineno))
        graph[module] = edges
    return graph


def _absolute(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return base


def circles(root: str | Path) -> list[Circle]:
    """One shortest loop per strongly connected group of modules (Tarjan), sorted."""
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # iterative Tarjan: deep chains do not hit the recursion limit
        work = [(v, iter(sorted(graph.get(v, {}))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        group.add(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, {})))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        path = _shortest_loop(graph, start, group)
        hops = list(zip(path, path[1:] + path[:1], strict=True))
        out.append(Circle(tuple(sorted(group)), tuple(path), tuple(graph[a][b] for a, b in hops)))
    return sorted(out, key=lambda c: c.path)


def _shortest_loop(graph: dict, start: str, group: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``group`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in group:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected group always has a loop")


def check(root: str | Path) -> list[Violation | TopLevelName]:
    root = Path(root)
    out: list[Violation | TopLevelName] = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(root, path)
            importer = unit_of(module)
            if importer is None:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            seen: set[tuple[int, str]] = set()
            for line, target in imports_of(tree, module, path.name == "__init__.py"):
                if target.split(".")[0] == "pipelines" and (line, "top") not in seen:
                    seen.add((line, "top"))
                    out.append(TopLevelName(str(path.relative_to(root)), line, importer, target))
                    continue
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
    loops = circles(root)
    for v in violations:
        print(v)
    for c in loops:
        print(c)
    if violations or loops:
        print(
            f"{len(violations)} layering violation(s), {len(loops)} import circle(s)",
            file=sys.stderr,
        )
        return 1
    print("layering: ok (no import circles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
