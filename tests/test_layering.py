"""The layering check passes on the project and fails on a wrong-way import."""

from __future__ import annotations

import importlib.util
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
    (tmp_path / "prx_data/export/bad_job.py").write_text("import pipelines.write_mds\n")
    found = {(v.path, v.imported) for v in _checker().check(tmp_path)}
    assert found == {
        ("prx_data/core/bad_core.py", "stream"),
        ("prx_data/table/bad_lazy.py", "train"),
        ("prx_data/skips/bad_rel.py", "stream"),
        ("prx_data/ingest/bad_same.py", "columns"),
        ("prx_data/export/bad_job.py", "pipelines"),
    }
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "prx_data/core/bad_core.py:1: core (layer 0) imports stream (layer 5)" in r.stdout
