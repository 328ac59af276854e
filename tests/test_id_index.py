"""The export's id index (``_ids.lance``) and the skip-list users that bind ids through it."""

from __future__ import annotations

import glob
import logging
import os
import shutil

import pyarrow as pa
import pytest

from prx_data.cli.skips import main as skips_main
from prx_data.export import idindex as I
from prx_data.export import layout, naming, safety
from prx_data.skips import dedup, optout
from prx_data.skips.bind import bind
from prx_data.skips.log import Provenance
from prx_data.skips.ops import update_list
from prx_data.skips.rewrite import rewrite_export
from tests.exportkit import FakeExport, make_export, upload_tree

B1, B2, B3 = "512/1.000", "512/0.500", "1024/1.000"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("idx") / "ex")
    return make_export(root, {B1: 30, B2: 12, B3: 7}, samples_per_part=8, samples_per_shard=3)


@pytest.fixture()
def pair(template, tmp_path):
    """Two copies of one export: ``new`` keeps its id index, ``old`` has none (older trees)."""
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    shutil.copytree(template.root, new)
    shutil.copytree(template.root, old)
    shutil.rmtree(os.path.join(old, naming.IDS_INDEX_NAME))
    return FakeExport(new, template.ids, template.where), FakeExport(
        old, template.ids, template.where
    )


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t[c].to_pylist() for c in ("id", "bucket", "shard", "index")), strict=True))


def _sidecars(root: str) -> dict[str, bytes]:
    out = {}
    for path in glob.glob(os.path.join(root, "*", "*", "*", "*.skip")):
        with open(path, "rb") as f:
            out[os.path.relpath(path, root)] = f.read()
    return out


def _drop_manifests(root: str) -> None:
    """Proof that a lookup went through the index: the manifests are gone."""
    for path in glob.glob(os.path.join(root, "*", "*", "*", "ids.parquet")):
        os.remove(path)


def test_export_writes_an_index_that_matches_the_manifests(template):
    index, why = I.open_index(template.root)
    assert index is not None, why
    assert index.rows == sum(len(v) for v in template.ids.values())
    table = index.dataset.to_table()
    assert _rows(table) == _rows(layout.read_manifests(template.root))
    assert any(i["fields"] == ["id"] and i["type"] == "BTree" for i in index.dataset.list_indices())
    assert safety.foreign_entries(template.root) == []  # --overwrite / --resume accept it


def test_lookup_of_a_stream_by_btree_and_by_scan_give_the_same_rows(template, monkeypatch):
    index, _ = I.open_index(template.root)
    wanted = [f"ds/{B1}/{i}" for i in (0, 4, 29)] + [f"ds/{B3}/6", "ds/none/1", "it's\\odd"]
    expect = sorted((i, *template.where[i]) for i in wanted if i in template.where)
    monkeypatch.setattr(I, "LOOKUP_CHUNK", 2)  # the stream is taken two ids at a time
    monkeypatch.setattr(I, "IN_CHUNK", 1)
    monkeypatch.setattr(I, "SCAN_RATIO", 0)  # never a scan: the BTREE, one id per query
    by_btree = [r for t in index.lookup(iter(wanted)) for r in _rows(t)]
    monkeypatch.setattr(I, "LOOKUP_CHUNK", 100)
    monkeypatch.setattr(I, "SCAN_RATIO", 10**6)  # every chunk "large": one scan
    by_scan = [r for t in index.lookup(pa.array(wanted)) for r in _rows(t)]
    assert sorted(by_btree) == sorted(by_scan) == expect


def test_skips_add_ids_through_the_index_equals_the_manifest_path(pair, tmp_path, capsys, caplog):
    new, old = pair
    ids = tmp_path / "ids.txt"
    ids.write_text(f"ds/{B1}/0\nds/{B1}/17\nds/{B2}/11\nds/{B3}/3\nnot/there\n")
    _drop_manifests(new.root)  # the index alone must be enough
    with caplog.at_level(logging.WARNING, logger="prx_data.skips"):
        assert skips_main(["add", new.root, "optout", "--ids", str(ids), "--export-only"]) == 0
        out_new = capsys.readouterr().out
        assert not caplog.records
        assert skips_main(["add", old.root, "optout", "--ids", str(ids), "--export-only"]) == 0
        out_old = capsys.readouterr().out
    [line] = [r.getMessage() for r in caplog.records]
    assert "has no id index" in line and "skips index" in line
    assert out_new.replace(new.root, "R") == out_old.replace(old.root, "R")
    assert "1 ids not found in the export" in out_new  # missing ids are reported
    assert _sidecars(new.root) == _sidecars(old.root) and len(_sidecars(new.root)) == 4


def test_optout_and_dedup_give_the_same_sidecars_as_the_manifest_path(pair):
    new, old = pair
    ids = [f"ds/{B1}/{i}" for i in range(0, 30, 4)] + [f"ds/{B2}/2", "gone/1", "gone/2"]
    reports = []
    for ex in (new, old):
        r = optout.add_optout(ex.root, "optout", ids, export_only=True)
        reports.append((r.samples_in_list, r.not_matched, r.buckets))
        rows = pa.table({"id": [f"ds/{B3}/{i}" for i in (1, 5)] + [f"ds/{B2}/3"]})
        d = dedup.replace_skip_list(ex.root, "dedup", rows)
        reports.append((d["samples_listed"], d["shards_written"]))
    assert reports[0] == reports[2] and reports[1] == reports[3]
    assert reports[0][1] == ["gone/1", "gone/2"]
    assert _sidecars(new.root) == _sidecars(old.root)


def test_lookup_or_manifests_uses_the_index(pair):
    """The index alone finds the rows (the manifests are gone); a tree without one reads them."""
    new, old = pair
    ids = pa.array(sorted([f"ds/{B2}/{i}" for i in (0, 7)] + ["nope"]))
    _drop_manifests(new.root)

    def rows(root: str) -> list[tuple]:
        hits = list(I.lookup_or_manifests(root, ids))
        cols = ("id", "bucket", "shard", "index")
        return sorted(r for t in hits for r in zip(*(t[c].to_pylist() for c in cols), strict=True))

    assert rows(new.root) == rows(old.root)
    assert [r[0] for r in rows(new.root)] == [f"ds/{B2}/0", f"ds/{B2}/7"]


def test_a_changed_tree_is_not_looked_up_until_the_index_is_rebuilt(pair, capsys, caplog):
    new, _ = pair
    path = os.path.join(new.root, *B2.split("/"), "index.json")
    with open(path) as f:
        body = f.read()
    with open(path, "w") as f:  # the same shards, other bytes: as a re-merge would write them
        f.write(body + "\n")
    index, why = I.open_index(new.root)
    assert index is None and "out of date" in why and B2 in why
    with caplog.at_level(logging.WARNING, logger="prx_data.skips"):
        bound = bind(new.root, {"x": pa.array([f"ds/{B2}/4"])})["x"]
    assert "out of date" in caplog.text
    assert bound.positions.keys() == {(B2, new.where[f"ds/{B2}/4"][1])}
    assert skips_main(["index", new.root, "--check"]) == 1
    assert skips_main(["index", new.root]) == 0
    assert skips_main(["index", new.root, "--check"]) == 0
    assert "current" in capsys.readouterr().out
    # Only one build's files stay behind.
    assert len(os.listdir(os.path.join(new.root, naming.IDS_INDEX_NAME, "_versions"))) <= 2


def test_rewrite_writes_a_current_index_of_the_new_tree(pair, tmp_path):
    new, _ = pair
    update_list(
        new.root,
        "optout",
        [f"ds/{B1}/{i}" for i in range(10)],
        Provenance("t"),
        export_only=True,
    )
    out = str(tmp_path / "rewritten")
    rewrite_export(new.root, out, force=True, verify=False)
    index, why = I.open_index(out)
    assert index is not None, why
    assert _rows(index.dataset.to_table()) == _rows(layout.read_manifests(out))
    assert index.rows == sum(len(v) for v in new.ids.values()) - 10


def test_index_is_left_out_of_the_content_digest(pair):
    new, old = pair
    assert layout.content_digest(new.root) == layout.content_digest(old.root)


def test_index_on_object_storage(template, s3_bucket, caplog):
    root = f"s3://{s3_bucket}/ex"
    upload_tree(template.root, root)
    assert safety.foreign_entries(root) == []
    index, why = I.open_index(root)
    assert index is not None, why
    info = I.write_id_index(root)  # rebuilt in place on s3
    assert info.rows == index.rows
    wanted = pa.array([f"ds/{B1}/3", f"ds/{B3}/0", "absent"])
    with caplog.at_level(logging.WARNING, logger="prx_data.skips"):
        bound = bind(root, {"x": wanted}, want_missing=["x"])["x"]
    assert not caplog.records
    assert bound.missing.to_pylist() == ["absent"] and bound.samples == 2
    assert sorted(bound.positions) == sorted(
        (template.where[i][0], template.where[i][1]) for i in (f"ds/{B1}/3", f"ds/{B3}/0")
    )


def test_hostile_names_in_the_index_or_its_manifests_are_refused(pair):
    import lance
    import pyarrow.parquet as pq

    new, _ = pair
    uri = I.index_uri(new.root)
    ds = lance.dataset(uri)
    record = ds.metadata[I.META_KEY]
    t = ds.to_table()
    shard = t["shard"].to_pylist()
    shard[t["id"].to_pylist().index(f"ds/{B1}/0")] = "../../victim/shard.00000.mds"
    t = t.set_column(t.schema.get_field_index("shard"), "shard", pa.array(shard, pa.string()))
    lance.write_dataset(t, uri, mode="overwrite").update_metadata({I.META_KEY: record})
    assert I.open_index(new.root)[0] is not None  # current by its record: the rows are refused
    with pytest.raises(safety.UnsafeIndexError, match="victim"):
        bind(new.root, {"x": pa.array([f"ds/{B1}/0"])})
    assert not glob.glob(os.path.join(new.root, "*", "*", "*", "*.skip"))
    part = new.where[f"ds/{B2}/0"][1].split("/")[0]
    path = os.path.join(new.root, *B2.split("/"), part, "ids.parquet")
    m = pq.read_table(path)
    bad = ["../x/shard.00000.mds"] + m["shard"].to_pylist()[1:]
    pq.write_table(m.set_column(0, "shard", pa.array(bad, pa.string())), path)
    with pytest.raises(safety.UnsafeIndexError, match="ids.parquet"):
        I.write_id_index(new.root)
