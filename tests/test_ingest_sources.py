"""Source readers (parquet, WebDataset, twin tars, Lance), then one mixed Ray ingest."""

from __future__ import annotations

import json
import os

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prx_data.pipelines.ingest import duplicate_ids, ingest

from prx_data.ingest import Counts, SourceSpec, detect_format, load_unit, plan_source
from tests.ingest_data import jpeg, make_tar, png, write


def _load_all(spec: SourceSpec, **options) -> tuple[dict[str, dict], Counts]:
    plan = plan_source(spec, **options)
    counts = Counts(plan.counts)
    rows = {}
    for unit in plan.units:
        t = load_unit(unit, counts)
        counts.tally_notes(t["__notes"].to_pylist())
        for r in t.to_pylist():
            assert r["id"] not in rows
            rows[r["id"]] = r
    if plan.finalize is not None:
        plan.finalize(counts)
    return rows, counts


# --- parquet -----------------------------------------------------------------


def test_parquet_hf_export_with_image_struct_and_embedding(tmp_path):
    path = str(tmp_path / "hf" / "train-00000.parquet")
    os.makedirs(os.path.dirname(path))
    table = pa.table(
        {
            "image": [{"bytes": jpeg(320, 240), "path": "x.jpg"}, {"bytes": b"junk", "path": None}],
            "text": ["a photo", None],
            "width": [999, 999],  # clashes with the table's own column: kept as src_width
            "aesthetic": [6.5, 4.0],
            "clip_embedding": [[0.1, 0.2, 0.3], [0.0, 1.0, 0.0]],
        }
    )
    pq.write_table(table, path)
    assert detect_format(path) == "parquet"
    rows, counts = _load_all(SourceSpec(path, name="hf"))
    a = rows["hf/0"]
    assert (a["width"], a["height"], a["format"], a["caption"]) == (320, 240, "jpeg", "a photo")
    assert a["src_width"] == 999 and a["aesthetic"] == 6.5
    assert a["embedding"] == pytest.approx([0.1, 0.2, 0.3])
    b = rows["hf/1"]
    assert b["probe_error"] == "not_an_image" and b["image"] == b"junk"
    assert counts["kept:caption_missing"] == 1 and counts["kept:probe_error:not_an_image"] == 1
    # The export's folder (as Hugging Face lays it out) is detected too; keys name the file.
    assert detect_format(str(tmp_path / "hf")) == "parquet"
    rows, _ = _load_all(SourceSpec(str(tmp_path / "hf")))
    assert sorted(rows) == ["hf/train-00000/0", "hf/train-00000/1"]


def test_parquet_laion_metadata_and_path_column(tmp_path):
    laion = str(tmp_path / "laion.parquet")
    pq.write_table(
        pa.table(
            {
                "key": ["000001", "000002"],
                "url": ["http://x/1.jpg", "http://x/2.jpg"],
                "TEXT": ["a cat", "a dog"],
                "WIDTH": [640, 800],
                "similarity": [0.31, 0.29],
            }
        ),
        laion,
    )
    rows, counts = _load_all(SourceSpec(laion))
    r = rows["laion/000001"]
    assert r["caption"] == "a cat" and r["url"] == "http://x/1.jpg" and r["src_width"] == 640
    assert r["image"] is None and r["probe_error"] == "missing_image"
    assert counts["kept:probe_error:missing_image"] == 2

    write(str(tmp_path / "imgs" / "p1.jpg"), jpeg(100, 50))
    paths = str(tmp_path / "imgs" / "meta.parquet")
    pq.write_table(
        pa.table({"file_name": ["p1.jpg", "gone.jpg"], "caption": [b"caf\xe9", b"ok"]}), paths
    )
    rows, counts = _load_all(SourceSpec(paths, fmt="parquet"))
    assert rows["meta/0"]["width"] == 100 and rows["meta/0"]["source_file"] == "p1.jpg"
    assert rows["meta/0"]["caption"] == "caf\ufffd"
    assert rows["meta/1"]["probe_error"] == "read_error:FileNotFoundError"
    assert counts["kept:caption_not_utf8"] == 1

    with pytest.raises(ValueError, match="not in the source"):
        plan_source(SourceSpec(paths), caption_column="nope")


# --- WebDataset --------------------------------------------------------------


def test_webdataset_tars_with_a_corrupt_one(tmp_path):
    root = tmp_path / "wds"
    make_tar(
        str(root / "shard-000.tar"),
        [
            ("s/k1.jpg", jpeg(64, 48)),
            ("s/k1.txt", "first"),
            ("s/k2.left.png", png(10, 20)),
            ("s/k2.json", json.dumps({"caption": "second", "url": "http://u"})),
            ("s/k3.txt", "no image here"),
            ("s/k4.jpg", jpeg(30, 30)),
            ("s/k4.txt", b"\xff\xfe bad"),
        ],
    )
    make_tar(str(root / "shard-001.tar"), [("k5.jpg", jpeg(50, 50)), ("k5.txt", "fifth")])
    write(str(root / "shard-002.tar"), b"this is not a tar at all" * 50)
    assert detect_format(str(root)) == "webdataset"
    rows, counts = _load_all(SourceSpec(str(root)))
    assert set(rows) == {"wds/s/k1", "wds/s/k2", "wds/s/k4", "wds/k5"}
    assert rows["wds/s/k1"]["caption"] == "first"
    assert rows["wds/s/k2"]["caption"] == "second" and rows["wds/s/k2"]["format"] == "png"
    assert json.loads(rows["wds/s/k2"]["metadata"]) == {"url": "http://u"}
    assert rows["wds/s/k2"]["source_file"] == "shard-000.tar:s/k2.left.png"
    assert "\ufffd" in rows["wds/s/k4"]["caption"]
    assert counts["dropped:corrupt_tar"] == 1
    assert counts["dropped:sample_without_image"] == 1
    assert counts["kept:caption_not_utf8"] == 1


def test_webdataset_truncated_tar_keeps_what_was_read(tmp_path):
    path = str(tmp_path / "t" / "a.tar")
    make_tar(path, [(f"{i:03d}.jpg", jpeg(40, 40)) for i in range(6)])
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    rows, counts = _load_all(SourceSpec(path))
    assert 1 <= len(rows) < 6
    assert counts["dropped:corrupt_tar"] == 1


# --- twin tars ---------------------------------------------------------------


def _twin(root, shards: dict[str, list[str]], caption_keys: dict[str, list[str]] | None = None):
    for shard, keys in shards.items():
        make_tar(
            f"{root}/image/{shard}", [(f"{k}.jpg", jpeg(32 + i, 32)) for i, k in enumerate(keys)]
        )
        ck = (caption_keys or {}).get(shard, keys)
        if ck is not None:
            make_tar(f"{root}/caption/{shard}", [(f"{k}.txt", f"caption of {k}") for k in ck])
        make_tar(
            f"{root}/meta/{shard}",
            [(f"{k}.json", json.dumps({"score": i})) for i, k in enumerate(keys)],
        )
    write(
        f"{root}/image/wdinfo.json",
        json.dumps(
            {
                "wids_version": 1,
                "shardlist": [{"url": s, "nsamples": len(k)} for s, k in shards.items()],
            }
        ),
    )


def test_twintar_zip_mode_counts_missing_modality(tmp_path):
    root = str(tmp_path / "twin")
    _twin(root, {"00000.tar": ["a", "b", "c"], "00001.tar": ["d", "e"]}, {"00001.tar": None})
    assert detect_format(root) == "twintar"
    rows, counts = _load_all(SourceSpec(root))
    assert set(rows) == {f"twin/{k}" for k in "abcde"}
    assert rows["twin/b"]["caption"] == "caption of b"
    assert json.loads(rows["twin/b"]["metadata"]) == {"meta": {"score": 1}}
    assert rows["twin/d"]["caption"] is None
    assert counts["kept:missing_modality:caption"] == 2


def test_twintar_zip_mode_notes_key_mismatch(tmp_path):
    root = str(tmp_path / "twin")
    _twin(root, {"00000.tar": ["a", "b"]}, {"00000.tar": ["b", "a"]})
    rows, counts = _load_all(SourceSpec(root))
    # Positional: the first caption goes with the first image, and the mismatch is counted.
    assert rows["twin/a"]["caption"] == "caption of b"
    assert counts["kept:key_mismatch:caption"] == 2


def test_twintar_index_mode_tolerates_missing_and_out_of_order_keys(tmp_path):
    root = str(tmp_path / "twin")
    _twin(root, {"00000.tar": ["a", "b", "c"], "00001.tar": ["d", "e"]}, {"00000.tar": ["c", "a"]})
    keys = str(tmp_path / "keys.parquet")
    pq.write_table(pa.table({"key": ["e", "c", "zz", "a", "b"]}), keys)
    rows, counts = _load_all(SourceSpec(root), keys=keys)
    assert set(rows) == {"twin/a", "twin/b", "twin/c", "twin/e"}
    assert rows["twin/c"]["caption"] == "caption of c"  # matched by key, not position
    assert rows["twin/a"]["caption"] == "caption of a"
    assert rows["twin/b"]["caption"] is None
    assert counts["kept:missing_modality:caption"] == 1  # b
    assert counts["dropped:not_in_key_list"] == 1  # d
    assert counts["dropped:key_not_found"] == 1  # zz
    assert "internal:keys_found" not in counts


# --- Lance table and the mixed Ray ingest ---------------------------------------


def test_lance_table_source_keeps_columns_and_embedding(tmp_path):
    src = str(tmp_path / "other.lance")
    lance.write_dataset(
        pa.table(
            {
                "id": ["x/1", "x/2"],
                "image": pa.array([jpeg(70, 35), png(5, 5)], pa.large_binary()),
                "width": pa.array([1, 1], pa.int32()),  # stale: recomputed from the header
                "caption": ["one", "two"],
                "label": ["cat", "dog"],
                "embedding": pa.array(
                    [np.ones(4, np.float32), np.zeros(4, np.float32)], pa.list_(pa.float32(), 4)
                ),
            }
        ),
        src,
    )
    assert detect_format(src) == "lance"
    rows, _ = _load_all(SourceSpec(src))
    assert rows["other/x/1"]["width"] == 70 and rows["other/x/1"]["label"] == "cat"
    assert rows["other/x/2"]["embedding"] == [0, 0, 0, 0]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_mixed_sources_in_one_ingest(tmp_path):
    make_tar(str(tmp_path / "wds" / "0.tar"), [("k1.jpg", jpeg(64, 64)), ("k1.txt", "wds one")])
    write(str(tmp_path / "wds" / "1.tar"), b"garbage" * 100)
    pq.write_table(
        pa.table(
            {"image": [jpeg(80, 60), jpeg(81, 60)], "caption": ["p0", "p1"], "key": ["k1", "k1"]}
        ),
        str(tmp_path / "pq.parquet"),
    )
    uri = str(tmp_path / "t.lance")
    report = ingest([str(tmp_path / "wds"), str(tmp_path / "pq.parquet")], uri, progress=False)
    assert report.rows_written == 2  # wds/k1 and pq/k1 (its second k1 is a duplicate)
    assert report.dropped == {"corrupt_tar": 1, "duplicate_id": 1}
    t = lance.dataset(uri).to_table(columns=["id", "caption", "metadata"])
    assert sorted(t["id"].to_pylist()) == ["pq/k1", "wds/k1"]
    assert duplicate_ids(uri) == 0


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_append_adds_new_source_columns_and_embeddings(tmp_path):
    write(str(tmp_path / "photos" / "a.jpg"), jpeg(40, 40))
    uri = str(tmp_path / "t.lance")
    ingest([str(tmp_path / "photos")], uri, progress=False)
    vec = pa.list_(pa.float32(), 3)
    pq.write_table(
        pa.table(
            {
                "image": [jpeg(50, 40)],
                "caption": ["from parquet"],
                "aesthetic": [5.5],
                "embedding": pa.array([[1.0, 0.0, 0.0]], vec),
            }
        ),
        str(tmp_path / "extra.parquet"),
    )
    report = ingest([str(tmp_path / "extra.parquet")], uri, progress=False)
    assert report.rows_written == 1 and report.rows_in_table == 2
    ds = lance.dataset(uri)
    assert ds.schema.field("aesthetic").type == pa.float64()
    assert ds.schema.field("embedding").type == vec
    rows = {
        r["id"]: r
        for r in ds.to_table(columns=["id", "aesthetic", "embedding", "source_file"]).to_pylist()
    }
    assert rows["photos/a"]["aesthetic"] is None and rows["photos/a"]["source_file"] == "a.jpg"
    assert rows["extra/0"]["aesthetic"] == 5.5 and rows["extra/0"]["embedding"] == [1.0, 0.0, 0.0]
    # Overwrite with another schema: the table takes the new source's columns.
    over = ingest([str(tmp_path / "extra.parquet")], uri, mode="overwrite", progress=False)
    assert over.rows_in_table == 1
    assert "source_file" not in lance.dataset(uri).schema.names
    # ... and back to a folder (more columns than the table has now).
    back = ingest([str(tmp_path / "photos")], uri, mode="overwrite", progress=False)
    assert back.rows_in_table == 1 and "source_file" in lance.dataset(uri).schema.names
