"""The layering check passes on the project and fails on a wrong-way import."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_layers.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_project_respects_the_layers():
    assert [str(v) for v in _checker().check(ROOT)] == []


def test_project_has_no_import_circles():
    assert [str(c) for c in _checker().circles(ROOT)] == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in ("prx_data", "prx_data/core", "prx_data/stream"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipelines").mkdir(exist_ok=True)
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_circles_closed_lazily_or_for_types_fail_the_check(tmp_path):
    root = _tree(
        tmp_path,
        {
            # A circle closed by a type-only import, one closed inside a function,
            # and a three-module loop through a relative import.
            "prx_data/stream/spec.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from prx_data.stream.dataset import Thing\n",
            "prx_data/stream/dataset.py": "from prx_data.stream.spec import Spec\n",
            "prx_data/core/a.py": "def f():\n    from prx_data.core import b\n",
            "prx_data/core/b.py": "import prx_data.core.a\n",
            "prx_data/core/x.py": "from . import y\n",
            "prx_data/core/y.py": "from prx_data.core.z import name\n",
            "prx_data/core/z.py": "from prx_data.core.x import other\n",
            # Not circles: a package naming its submodule, and an import of a sibling.
            "prx_data/core/ok.py": "from prx_data.core import a\n",
        },
    )
    found = {c.path for c in _checker().circles(root)}
    assert found == {
        ("prx_data.core.a", "prx_data.core.b"),
        ("prx_data.core.x", "prx_data.core.y", "prx_data.core.z"),
        ("prx_data.stream.dataset", "prx_data.stream.spec"),
    }
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "import circle: 2 modules import each other (prx_data.stream.dataset, " in r.stdout
    assert "prx_data/stream/spec.py:3" in r.stdout  # the type-only import is named


def test_a_dag_passes_the_circle_check(tmp_path):
    root = _tree(
        tmp_path,
        {
            "prx_data/stream/spec.py": "import numpy\n",
            "prx_data/stream/leader.py": "import os\n",
            "prx_data/stream/catalog.py": "from prx_data.stream import leader, spec\n",
            "prx_data/stream/dataset.py": "from prx_data.stream.catalog import f\n"
            "def g():\n    from prx_data.stream.spec import Spec\n",
        },
    )
    assert _checker().circles(root) == []


def test_wrong_way_imports_fail_the_check(tmp_path):
    for pkg in ("prx_data", "pipelines"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    # A pure module reaching up to the loader, a lazy import in a function, a
    # relative import, a same-layer import, and a library module importing a job.
    (tmp_path / "prx_data/core/bad_core.py").write_text("from prx_data.stream import planner\n")
    (tmp_path / "prx_data/table/bad_lazy.py").write_text(
        "def f():\n    import prx_data.train.config\n"
    )
    (tmp_path / "prx_data/skips/bad_rel.py").write_text("from ..stream import dataset\n")
    (tmp_path / "prx_data/ingest/bad_same.py").write_text("from prx_data.columns import checks\n")
    (tmp_path / "prx_data/export/bad_job.py").write_text("import prx_data.pipelines.write_mds\n")
    # The jobs by their folder's name: a second name for the same modules.
    (tmp_path / "prx_data/cli/bad_name.py").write_text("from pipelines import write_mds\n")
    found = {(v.path, v.imported) for v in _checker().check(tmp_path)}
    assert found == {
        ("prx_data/core/bad_core.py", "stream"),
        ("prx_data/table/bad_lazy.py", "train"),
        ("prx_data/skips/bad_rel.py", "stream"),
        ("prx_data/ingest/bad_same.py", "columns"),
        ("prx_data/export/bad_job.py", "pipelines"),
        ("prx_data/cli/bad_name.py", "pipelines.write_mds"),
    }
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "prx_data/core/bad_core.py:1: core (layer 0) imports stream (layer 5)" in r.stdout
    assert "bad_name.py:1: imports 'pipelines.write_mds' by its folder name" in r.stdout


def test_the_loaders_value_types_and_leader_protocol_load_without_torch():
    probe = (
        "import sys\n"
        "from prx_data.stream.spec import BucketSource, DatasetSpec\n"
        "from prx_data.stream import leader, planner\n"
        "DatasetSpec('/data/export'); planner.PlanSpec(tier=512, device_batch_size=4)\n"
        "print(sorted(m for m in ('torch', 'streaming') if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


#: The skip-list rooms, lowest first (prx_data/skips/__init__.py): each imports only rooms
#: before it, so a room can be read, tested or replaced with those below it alone.
SKIPS_ROOMS = [
    "errors",
    "content",
    "sidecar",
    "log",
    "place",
    "ledger",
    "export_state",
    "which",
    "bind",
    "recover",
    "materialise",
    "ops",
]


def _skips_imports(path: Path) -> set[str]:
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "prx_data.skips":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prx_data.skips."):
            out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {
                a.name.split(".")[2] for a in node.names if a.name.startswith("prx_data.skips.")
            }
    return out & set(SKIPS_ROOMS)


def test_the_skip_list_rooms_import_one_way():
    folder = ROOT / "prx_data" / "skips"
    assert not (folder / "lists.py").exists()
    wrong = []
    for i, room in enumerate(SKIPS_ROOMS):
        for dep in sorted(_skips_imports(folder / f"{room}.py")):
            if SKIPS_ROOMS.index(dep) >= i:
                wrong.append(f"{room} imports {dep}")
    assert wrong == []
