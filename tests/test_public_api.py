"""The docs teach only the public API: every ``prx_data`` name they use is in an ``__all__``.

README.md, docs/*.md and the examples (notebooks: their code cells) name library
objects as ``from prx_data.x import Y`` or as dotted paths (``prx_data.x.y.Z``).
A name used there must be listed in the ``__all__`` of the module it is taken
from, or of that module's package; a module named there must exist. So renaming
or hiding a name the docs use fails here, with the offending line, instead of
leaving a reader with an ImportError.

Everything is read statically (the ``__all__`` literals, or the keys of a
package's lazy ``_EXPORTS``), so the check imports nothing and takes no time.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Every package of the library; each names its public API in ``__all__``.
PACKAGES = (
    "prx_data",
    "prx_data.core",
    "prx_data.table",
    "prx_data.ingest",
    "prx_data.columns",
    "prx_data.export",
    "prx_data.download",
    "prx_data.explore",
    "prx_data.skips",
    "prx_data.stream",
    "prx_data.train",
    "prx_data.cli",
)

_FROM = re.compile(r"\bfrom\s+(prx_data(?:\.\w+)*)\s+import\s+(\(?[^#\n]*)")
_DOTTED = re.compile(r"(?<![\w.])prx_data(?:\.[A-Za-z_]\w*)+")


def _source(module: str) -> Path | None:
    """The file of ``module`` (``prx_data.pipelines`` is the top-level ``pipelines/``)."""
    parts = module.split(".")
    if parts[:2] == ["prx_data", "pipelines"]:
        base = ROOT.joinpath("pipelines", *parts[2:])
    else:
        base = ROOT.joinpath(*parts)
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


@cache
def public_names(module: str) -> frozenset[str] | None:
    """The names in ``module``'s ``__all__``: the literal, or a lazy package's ``_EXPORTS`` keys.

    None when the module has no ``__all__``.
    """
    path = _source(module)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    values: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                for name in names:
                    if isinstance(name, ast.Name):
                        values[name.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            values[node.target.id] = node.value
    value = values.get("__all__")
    if value is None:
        return None
    if isinstance(value, ast.Call):  # __all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
        exports = values.get(getattr(value.args[1], "id", ""))
        return frozenset(ast.literal_eval(exports))
    return frozenset(ast.literal_eval(value))


def _package(module: str) -> str | None:
    """The package whose ``__all__`` also counts for ``module``'s names (not the top level)."""
    parent = module.rpartition(".")[0]
    return parent if parent not in ("", "prx_data") else None


def check_name(module: str, name: str) -> str | None:
    """Why ``module.name`` is not public API, or None when it is."""
    if _source(module) is None:
        return f"there is no module {module}"
    if _source(f"{module}.{name}") is not None:  # a submodule: public unless underscored
        return f"{module}.{name} is private" if name.startswith("_") else None
    package = _package(module)
    if name in (public_names(module) or ()) or (package and name in (public_names(package) or ())):
        return None
    return f"{name} is not in {module}.__all__" + (f" nor {package}.__all__" if package else "")


def check_dotted(path: str) -> str | None:
    """``prx_data.a.b`` (a module) or ``prx_data.a.b.Name[.attr]`` (a name in an ``__all__``)."""
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        if _source(module) is not None:
            break
    else:
        return f"there is no module {parts[0]}"
    private = [p for p in parts[1:n] if p.startswith("_") and p != "__main__"]
    if private:
        return f"{module} is private"
    return None if n == len(parts) else check_name(module, parts[n])


def doc_lines() -> list[tuple[str, int, str]]:
    """(file, line number, text) of the docs and the examples' code cells."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        out += [(path.name, i, line) for i, line in enumerate(text.splitlines(), 1)]
    examples = ROOT / "examples"
    for path in sorted(examples.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        out += [(str(path.relative_to(ROOT)), i, t) for i, t in enumerate(text.splitlines(), 1)]
    for path in sorted(examples.rglob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for c, cell in enumerate(cells):
            if cell.get("cell_type") == "code":
                src = cell.get("source", "")
                text = "".join(src) if isinstance(src, list) else src
                name = f"{path.relative_to(ROOT)} cell {c}"
                out += [(name, i, t) for i, t in enumerate(text.splitlines(), 1)]
    return out


def problems(lines: list[tuple[str, int, str]]) -> list[str]:
    """One line per use of a name outside the public API: where, the text, and why."""
    out = []
    index = {(f, i): t for f, i, t in lines}
    for f, i, text in lines:
        found = []
        for m in _FROM.finditer(text):
            module, names = m.group(1), m.group(2)
            if names.startswith("("):  # from x import (\n a,\n b,\n)
                j, names = i, names[1:]
                while ")" not in names and (f, j + 1) in index:
                    j += 1
                    names += " " + index[(f, j)]
                names = names.split(")")[0]
            for item in names.split(","):
                name = item.split(" as ")[0].strip().strip("`")
                if re.fullmatch(r"\w+", name):
                    found.append((f"{module}.{name}", check_name(module, name)))
        rest = _FROM.sub(" ", text)
        for m in _DOTTED.finditer(rest):
            found.append((m.group(0), check_dotted(m.group(0))))
        out += [f"{f}:{i}: {ref}: {why}  | {text.strip()}" for ref, why in found if why]
    return out


def test_every_package_names_its_public_api():
    missing = [p for p in PACKAGES if public_names(p) is None]
    assert not missing, f"packages without __all__: {missing}"
    for package in PACKAGES:
        names = public_names(package)
        assert names, package
        private = sorted(n for n in names if n.startswith("_"))
        assert not private, f"{package}.__all__ lists private names {private}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_a_package_all_exists(package):
    """A name in ``__all__`` is defined, imported or lazily exported by the package."""
    names = public_names(package) or frozenset()
    tree = ast.parse(_source(package).read_text(encoding="utf-8"))
    defined = {
        n.id
        for node in ast.walk(tree)
        for n in ([node] if isinstance(node, ast.Name) else [])
        if isinstance(n.ctx, ast.Store)
    }
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
    lazy = (
        any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) for node in tree.body)
        and "_EXPORTS" in defined
    )
    submodules = {n for n in names if _source(f"{package}.{n}") is not None}
    unknown = sorted(names - defined - submodules) if not lazy else []
    assert not unknown, f"{package}.__all__ names {unknown}, which it does not define"


def test_the_docs_use_only_names_in_an_all():
    lines = doc_lines()
    assert any("prx_data" in t for _, _, t in lines)  # the docs were read
    bad = problems(lines)
    assert not bad, "names the docs use are not public API:\n" + "\n".join(bad)


def test_the_check_names_the_offending_line():
    lines = [
        ("README.md", 1, "from prx_data.stream import BucketedDataset"),
        ("README.md", 2, "from prx_data.stream import _not_public, DatasetSpec"),
        ("README.md", 3, "see `prx_data.stream.planner.no_such_name` and `prx_data.nowhere`"),
        ("README.md", 4, "python -m prx_data.write_mds"),
    ]
    assert problems(lines) == [
        "README.md:2: prx_data.stream._not_public: _not_public is not in prx_data.stream.__all__"
        "  | from prx_data.stream import _not_public, DatasetSpec",
        "README.md:3: prx_data.stream.planner.no_such_name: no_such_name is not in "
        "prx_data.stream.planner.__all__ nor prx_data.stream.__all__"
        "  | see `prx_data.stream.planner.no_such_name` and `prx_data.nowhere`",
        "README.md:3: prx_data.nowhere: nowhere is not in prx_data.__all__"
        "  | see `prx_data.stream.planner.no_such_name` and `prx_data.nowhere`",
    ]
