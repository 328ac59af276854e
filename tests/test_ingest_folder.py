"""Folder ingest: the reader alone, then the Ray Data job end to end."""

from __future__ import annotations

import json

import lance
import pytest
from prx_data.pipelines.ingest import duplicate_ids, ingest, output_schema

from prx_data.cli import ingest as ingest_cli
from prx_data.ingest import Counts, SourceSpec, conform, folder, load_unit, plan_source
from tests.ingest_data import jpeg, make_folder, write


def _rows(uri: str) -> dict[str, dict]:
    t = lance.dataset(uri).to_table()
    return {r["id"]: r for r in t.to_pylist()}


def test_folder_plan_and_load_without_ray(tmp_path):
    root = str(tmp_path / "photos")
    expected = make_folder(root)
    plan = plan_source(SourceSpec(root))
    assert plan.counts["dropped:duplicate_id"] == 1  # a.png shares a.jpg's id
    assert plan.counts["dropped:not_an_image_file"] == 1  # README.md
    assert plan.counts["dropped:sidecar_without_image"] == 1  # orphan.txt
    assert plan.approx_row_bytes and plan.approx_row_bytes > 50

    counts = Counts()
    tables = [load_unit(u, counts) for u in plan.units]
    rows = {r["id"]: r for t in tables for r in t.to_pylist()}
    assert set(rows) == {f"photos/{k}" for k in expected}
    for key, exp in expected.items():
        row = rows[f"photos/{key}"]
        for col, val in exp.items():
            assert row[col] == val, (key, col)
    assert rows["photos/sub/broken"]["probe_error"] == "not_an_image"
    assert rows["photos/sub/broken"]["image"] == b"\x89PNG not really"  # kept as found
    assert rows["photos/a"]["source_file"] == "a.jpg"
    assert json.loads(rows["photos/b"]["metadata"]) == {"score": 0.5}
    assert rows["photos/rot"]["__notes"] == ["caption_not_utf8"]
    assert rows["photos/sub/broken"]["__notes"] == ["caption_empty", "probe_error:not_an_image"]
    schema = output_schema(folder.EXTRA_FIELDS, None)
    t = conform(tables[0], schema)
    assert t.schema == schema and "__notes" not in t.column_names


def test_named_source_and_unit_size(tmp_path):
    root = str(tmp_path / "photos")
    make_folder(root)
    plan = plan_source(SourceSpec(root, name="web"), items_per_unit=2)
    assert len(plan.units) == 3  # 5 items in units of 2
    t = load_unit(plan.units[0], Counts())
    assert all(i.startswith("web/") for i in t["id"].to_pylist())


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_folder_ingest_end_to_end_and_reingest(tmp_path):
    root = str(tmp_path / "photos")
    expected = make_folder(root)
    uri = str(tmp_path / "t.lance")

    report = ingest([root], uri, items_per_unit=2, progress=False)
    assert report.rows_written == len(expected) == report.rows_in_table
    assert report.dropped == {
        "duplicate_id": 1,
        "not_an_image_file": 1,
        "sidecar_without_image": 1,
    }
    assert report.kept["caption_not_utf8"] == 1
    assert report.kept["probe_error:not_an_image"] == 1
    assert report.kept["caption_empty"] == 1
    rows = _rows(uri)
    for key, exp in expected.items():
        for col, val in exp.items():
            assert rows[f"photos/{key}"][col] == val
    assert "photos" in report.format()

    # Re-ingest: nothing new, nothing duplicated, nothing counted as a kept note.
    again = ingest([root], uri, progress=False)
    assert again.rows_written == 0
    assert again.dropped["already_in_table"] == len(expected)
    assert again.kept == {}
    assert again.rows_in_table == len(expected)
    assert duplicate_ids(uri) == 0

    # A new file: only it is added.
    write(f"{root}/new/c.jpg", jpeg(512, 512))
    write(f"{root}/new/c.txt", "new one")
    third = ingest([root], uri, progress=False)
    assert third.rows_written == 1
    assert _rows(uri)["photos/new/c"]["caption"] == "new one"
    assert duplicate_ids(uri) == 0

    with pytest.raises(FileExistsError):
        ingest([root], uri, mode="create", progress=False)
    over = ingest([f"other={root}"], uri, mode="overwrite", progress=False)
    assert over.rows_in_table == len(expected) + 1
    assert all(i.startswith("other/") for i in _rows(uri))


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_rows_per_fragment_and_cli(tmp_path, capsys):
    root = str(tmp_path / "many")
    for i in range(12):
        write(f"{root}/{i:02d}.jpg", jpeg(64 + i, 64))
    uri = str(tmp_path / "t.lance")
    code = ingest_cli.main(
        [
            root,
            "--table",
            uri,
            "--rows-per-fragment",
            "4",
            "--items-per-unit",
            "3",
            "--json",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") :])
    assert report["rows_written"] == 12 and report["rows_per_fragment"] == 4
    ds = lance.dataset(uri)
    sizes = [f.count_rows() for f in ds.get_fragments()]
    assert sum(sizes) == 12 and max(sizes) <= 4 and len(sizes) >= 3  # N is a cap, not N..2N
    assert sorted(ds.to_table(columns=["width"])["width"].to_pylist()) == list(range(64, 76))


@pytest.mark.timeout(120)
def test_a_small_ingest_stays_in_this_process_without_importing_ray(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "photos")
    make_folder(root)
    code = (
        "import sys\n"
        "from prx_data.pipelines.ingest import ingest\n"
        f"r = ingest([{root!r}], {str(tmp_path / 't.lance')!r}, items_per_unit=1, progress=False)\n"
        "print(r.units, r.rows_written, 'ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["5", "5", "False"]  # five units, more than a CPU's worth


def test_cli_help_explains_options(capsys):
    with pytest.raises(SystemExit):
        ingest_cli.main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--table", "--mode", "--format", "--rows-per-fragment", "--fragment-mb", "--keys"):
        assert opt in text
