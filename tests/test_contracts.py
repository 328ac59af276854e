"""One owner per contract: sample keys, sidecar naming and job-column names are spelled once,
and every job opens its Lance table through one opener that reads the environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pyarrow as pa

from prx_data.core import schema as S
from prx_data.export import naming

ROOT = Path(__file__).resolve().parents[1]


def _string_constants() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted([*ROOT.glob("prx_data/**/*.py"), *ROOT.glob("pipelines/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append((rel, node.lineno, node.value))
    return out


def test_an_exported_sample_has_exactly_the_mds_columns():
    sample = S.mds_sample(
        image=b"x", id="t/a", width=3, height=2, crop_box=(0, 0, 3, 2), tier=512, bucket="b"
    )
    assert list(sample) == list(S.MDS_COLUMNS)


def test_sidecar_naming_is_spelled_only_in_the_export_naming():
    from prx_data.skips import sidecar

    assert sidecar.SUFFIX is naming.SIDECAR_SUFFIX and sidecar.NAME_RE is naming.LIST_NAME_RE
    copies = [
        f"{rel}:{line}"
        for rel, line, value in _string_constants()
        if rel != "prx_data/export/naming.py"
        and (value == naming.SIDECAR_SUFFIX or naming.LIST_NAME_PATTERN in value)
    ]
    assert not copies, copies


def test_job_column_names_come_from_the_schema():
    assert S.error_column("caption_vlm") == "caption_vlm_error"
    assert S.status_column("caption_vlm") == "caption_vlm_status"
    defs = []
    for path in sorted([*ROOT.glob("prx_data/**/*.py"), *ROOT.glob("pipelines/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("error_column", "status_column"):
                defs.append(f"{rel}:{node.name}")
    assert sorted(defs) == [
        "prx_data/core/schema.py:error_column",
        "prx_data/core/schema.py:status_column",
    ]


def test_lance_tables_are_opened_in_one_place():
    calls = []
    for path in sorted([*ROOT.glob("prx_data/**/*.py"), *ROOT.glob("pipelines/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "dataset"
                and isinstance(f.value, ast.Name)
                and f.value.id == "lance"
            ):
                calls.append(rel)
    assert calls == ["prx_data/table/lance_ops.py"]


def test_the_opener_fills_storage_options_from_the_environment(monkeypatch):
    from prx_data.table import lance_ops

    seen = {}

    def fake_dataset(uri, version=None, storage_options=None):
        seen[uri] = storage_options
        return "ds"

    monkeypatch.setattr(lance_ops.lance, "dataset", fake_dataset)
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    lance_ops.open_table("s3://b/t.lance")
    lance_ops.open_table("s3://b/u.lance", {"aws_endpoint": "given"})
    lance_ops.open_table("/local/t.lance")
    assert seen == {
        "s3://b/t.lance": {
            "aws_endpoint": "http://127.0.0.1:9",
            "allow_http": "true",
            "aws_region": "eu-west-3",
        },
        "s3://b/u.lance": {"aws_endpoint": "given"},
        "/local/t.lance": None,
    }


def test_pinned_tables_share_one_bounded_cache(tmp_path, monkeypatch):
    import lance

    from prx_data.columns import runner
    from prx_data.table import lance_ops

    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"id": ["a"]}), uri)
    monkeypatch.setattr(lance_ops, "_PINNED", {})
    ds = runner._pinned(uri, 1, None, "run-1")
    assert lance_ops.pinned_table(uri, 1, None, "run-1") is ds  # the ingest's lookups too
    assert lance_ops.pinned_table(uri, 1, None, "run-2") is not ds  # a new run opens anew
    for i in range(lance_ops.PINNED_TABLES_MAX + 3):
        lance_ops.pinned_table(uri, 1, None, f"more-{i}")
    assert len(lance_ops._PINNED) == lance_ops.PINNED_TABLES_MAX
