"""Ingest de-duplication is deterministic, and a failed ingest commits nothing."""

from __future__ import annotations

import os
import random

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_data.pipelines import ingest as I
from tests.ingest_data import jpeg, write


def table_rows(uri: str) -> list[dict]:
    t = lance.dataset(uri).to_table()
    return sorted(t.to_pylist(), key=lambda r: r["id"])


def duplicated_sources(root: str) -> list[str]:
    """Two folders under one source name and a parquet file repeating a key across row groups."""
    for d, caption in (("a", "from folder a"), ("b", "from folder b")):
        write(f"{root}/{d}/same.jpg", jpeg(64 + len(d), 48, (200, 10, 10)))
        write(f"{root}/{d}/same.txt", caption)
        write(f"{root}/{d}/only-{d}.jpg", jpeg(50, 50))
    pq.write_table(
        pa.table(
            {
                "key": ["k1", "k2", "k1", "k3", "k2"],
                "image": [jpeg(40 + i, 40) for i in range(5)],
                "caption": [f"row {i}" for i in range(5)],
            }
        ),
        f"{root}/p.parquet",
        row_group_size=1,
    )
    return [f"s={root}/a", f"s={root}/b", f"{root}/p.parquet"]


@pytest.mark.ray
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_same_inputs_in_any_unit_order_give_the_same_table(tmp_path, monkeypatch, engine, request):
    if engine == "ray":
        request.getfixturevalue("ray_local")
    sources = duplicated_sources(str(tmp_path / "src"))
    orders = {
        "plan": lambda items: items,
        "reversed": lambda items: items[::-1],
        "shuffled": lambda items: random.Random(7).sample(items, len(items)),
    }
    tables = {}
    for name, order in orders.items():
        monkeypatch.setattr(I, "_schedule", order)
        uri = str(tmp_path / f"{name}.lance")
        report = I.ingest(sources, uri, items_per_unit=1, progress=False, engine=engine)
        assert report.rows_written == 6  # s/same, s/only-a, s/only-b, p/k1, p/k2, p/k3
        assert report.dropped["duplicate_id"] == 3
        assert I.duplicate_ids(uri) == 0
        tables[name] = table_rows(uri)
    assert tables["plan"] == tables["reversed"] == tables["shuffled"]
    rows = {r["id"]: r for r in tables["plan"]}
    # The first in source order wins: folder a before b, the first row group before later ones.
    assert rows["s/same"]["caption"] == "from folder a" and rows["s/same"]["width"] == 65
    assert rows["p/k1"]["caption"] == "row 0" and rows["p/k2"]["caption"] == "row 1"


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_one_commit_per_ingest_and_a_failure_leaves_the_table_as_it_was(tmp_path, monkeypatch):
    root = str(tmp_path / "src")
    write(f"{root}/photos/a.jpg", jpeg(40, 40))
    uri = str(tmp_path / "t.lance")
    I.ingest([f"{root}/photos"], uri, progress=False)
    before = lance.dataset(uri)
    v1, rows1, schema1 = before.version, table_rows(uri), before.schema

    # New rows with a new source column: one commit (no separate add-columns version).
    pq.write_table(
        pa.table({"image": [jpeg(50, 40)], "caption": ["x"], "aesthetic": [5.5]}),
        f"{root}/extra.parquet",
    )
    ok = I.ingest([f"{root}/extra.parquet"], uri, progress=False)
    assert ok.rows_written == 1 and lance.dataset(uri).version == v1 + 1
    assert "aesthetic" in lance.dataset(uri).schema.names
    v2, rows2, schema2 = lance.dataset(uri).version, table_rows(uri), lance.dataset(uri).schema

    def killed(*args, **kwargs):
        raise RuntimeError("killed before the commit")

    monkeypatch.setattr(I, "commit_ingest", killed)
    data = os.path.join(uri, "data")
    files_before = set(os.listdir(data))
    write(f"{root}/more/b.jpg", jpeg(60, 60))
    pq.write_table(
        pa.table({"image": [jpeg(30, 30)], "caption": ["y"], "brand_new": [1]}),
        f"{root}/other.parquet",
    )
    for sources, mode in (
        ([f"{root}/more"], "append"),
        ([f"{root}/other.parquet"], "append"),  # would add a column
        ([f"{root}/other.parquet"], "overwrite"),  # another schema
    ):
        with pytest.raises(RuntimeError, match="killed"):
            I.ingest(sources, uri, mode=mode, progress=False)
        ds = lance.dataset(uri)
        assert ds.version == v2 and ds.schema == schema2 and table_rows(uri) == rows2
    # The work was staged (files written) but never became part of the table.
    assert set(os.listdir(data)) > files_before
    monkeypatch.undo()
    assert rows1 != rows2 and schema1 != schema2
    over = I.ingest([f"{root}/other.parquet"], uri, mode="overwrite", progress=False)
    assert over.rows_in_table == 1 and lance.dataset(uri).version == v2 + 1
    assert "brand_new" in lance.dataset(uri).schema.names
    assert lance.dataset(uri, version=v2).to_table().num_rows == len(rows2)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_reingest_uses_the_id_index_and_skips_existing_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(I, "ID_INDEX_MIN_ROWS", 1)
    root = str(tmp_path / "photos")
    for i in range(6):
        write(f"{root}/{i}.jpg", jpeg(30 + i, 30))
    uri = str(tmp_path / "t.lance")
    first = I.ingest([root], uri, items_per_unit=2, progress=False)
    assert first.rows_written == 6
    ds = lance.dataset(uri)
    assert [i["fields"] for i in ds.list_indices()] == [["id"]]
    v = ds.version
    write(f"{root}/6.jpg", jpeg(80, 30))
    again = I.ingest([root], uri, items_per_unit=2, progress=False)
    assert again.rows_written == 1 and again.dropped == {"already_in_table": 6}
    assert lance.dataset(uri).version == v + 2  # the append, then the index update
    assert I.duplicate_ids(uri) == 0


def test_lookups_and_losers_without_ray(tmp_path):
    uri = str(tmp_path / "t.lance")
    ds = lance.write_dataset(
        pa.table({"id": ["a/1", "a/2", "ab/1", "b/x"], "v": [1, 2, 3, 4]}), uri
    )
    assert I.sources_in_table(ds, ["a", "b", "c", "ab", "a"]) == {"a", "ab", "b"}
    assert I.ids_in_table(ds, ["a/2", "zz", "b/x", "a/3"]) == {"a/2", "b/x"}
    claims = pa.table(
        {
            "fragment": ["f0", "f1"],
            "ids": [["x", "y", "x"], ["y", "z"]],
            "orders": [[5 << 32, 5 << 32 | 1, 5 << 32 | 2], [2 << 32, 2 << 32 | 1]],
            "notes": ["{}", "{}"],
        }
    )
    # x: the first of unit 5 wins; y: unit 2 comes first in the plan, so it wins.
    assert I.losers(claims) == {0: [1, 2]}
    assert I.losers(claims.slice(1)) == {}


def test_staging_runs_fill_a_fragment_and_keep_every_cpu_busy():
    from prx_data.ingest import WorkUnit

    folder = [WorkUnit("folder", "s", {"root": "r", "items": [["k", "k.jpg", None]] * 3})]
    tar = WorkUnit("webdataset", "s", {"tar": "t.tar", "root": "r"})  # size unknown
    # 3-row units, 10 rows a fragment: three units a run (9 rows), in plan order.
    assert I.stage_groups(folder * 7, 10, cpus=1) == [[0, 1, 2], [3, 4, 5], [6]]
    assert I.stage_groups(folder * 12, 10, cpus=1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    # A unit of unknown size fills a run by itself.
    assert I.stage_groups([*folder, tar, *folder], 10, cpus=1) == [[0], [1], [2]]
    # Never fewer than two runs per CPU while there are units for them.
    assert len(I.stage_groups(folder * 12, 10**6, cpus=3)) == 6
    assert I.stage_groups([], 10, cpus=2) == []
