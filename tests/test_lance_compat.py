"""The contract of prx_data.core.lance_compat against the installed pylance.

Each edit of fragment metadata the project makes, committed through Lance's
public API and read back: a pylance release that changes the fragment JSON
fails here first.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

import lance
import numpy as np
import pyarrow as pa
import pytest
from lance.file import LanceFileWriter

from prx_data.core import lance_compat


@pytest.fixture()
def table(tmp_path):
    uri = str(tmp_path / "t.lance")
    t = pa.table({"id": [f"s{i}" for i in range(6)], "score": pa.array([0.5] * 6, pa.float32())})
    return lance.write_dataset(t, uri, max_rows_per_file=3, data_storage_version="2.0")


def test_a_data_file_added_to_a_fragment_serves_its_fields_and_keeps_the_rest(table):
    ds = table
    frag = ds.get_fragments()[1]
    base = frag.metadata
    field = ds.lance_schema.field("score").id()
    name = "extra.lance"
    out = pa.schema([pa.field("score", pa.float32())])
    w = LanceFileWriter(f"{ds.uri}/data/{name}", out, version="2.0")
    w.write_batch(pa.table({"score": pa.array([1.0, 2.0, 3.0], pa.float32())}, schema=out))
    w.close()
    meta = lance_compat.with_data_file(base, name, [field], (2, 0), None)
    files = meta.to_json()["files"]
    assert files[0]["fields"] == [
        lance_compat.TOMBSTONE if i == field else i for i in base.to_json()["files"][0]["fields"]
    ]
    assert files[-1]["path"] == name and files[-1]["fields"] == [field]
    assert lance_compat.fragment_key(meta) != lance_compat.fragment_key(base)
    op = lance.LanceOperation.Update(
        updated_fragments=[meta], fields_modified=[field], update_mode="rewrite_columns"
    )
    after = lance.LanceDataset.commit(ds.uri, op, read_version=ds.version)
    got = after.to_table(columns=["id", "score"]).sort_by("id")
    assert got["id"].to_pylist() == [f"s{i}" for i in range(6)]
    np.testing.assert_array_equal(got["score"].to_numpy(), [0.5, 0.5, 0.5, 1.0, 2.0, 3.0])


def test_fragment_text_round_trips(table):
    meta = table.get_fragments()[0].metadata
    again = lance_compat.fragment_from_text(lance_compat.fragment_text(meta))
    assert again.to_json() == meta.to_json()
    assert lance_compat.fragment_from_text(lance_compat.fragment_text(meta).encode()).to_json() == (
        meta.to_json()
    )
    assert lance_compat.fragment_from_dict(meta.to_json()).to_json() == meta.to_json()
    assert lance_compat.fragment_key(again) == lance_compat.fragment_key(meta)


def test_an_unchecked_pylance_release_is_refused_with_what_to_check(monkeypatch):
    monkeypatch.setattr(metadata, "version", lambda dist: "99.0.0")
    monkeypatch.delitem(sys.modules, "prx_data.core.lance_compat")
    with pytest.raises(ImportError, match=r"pylance 14\.x, found 99\.0\.0.*SUPPORTED"):
        importlib.import_module("prx_data.core.lance_compat")
    monkeypatch.undo()
    assert importlib.import_module("prx_data.core.lance_compat").SUPPORTED == ("14.",)


def test_no_fragment_json_outside_the_compat_module():
    """Only lance_compat turns fragment metadata into JSON or back (``to_json``/``from_json``)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*root.glob("prx_data/**/*.py"), *root.glob("pipelines/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel == "prx_data/core/lance_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(
                a.name == "FragmentMetadata" for a in node.names
            ):
                found.append(f"{rel}:{node.lineno}: imports FragmentMetadata")
    assert not found, found
