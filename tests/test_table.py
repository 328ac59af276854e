"""prx_data.table.lance_ops: add/fill a column without rewriting images, resumability, compaction."""

from __future__ import annotations

import hashlib
import os
import random

import lance
import pyarrow as pa
import pytest

from prx_data.cli import table as table_cli
from prx_data.core import schema as S
from prx_data.table import lance_ops as T


def _make_table(uri: str, n: int = 10, rows_per_file: int = 4) -> None:
    rng = random.Random(0)
    data = pa.table(
        {
            "id": [f"src/{i:03d}" for i in range(n)],
            "image": pa.array([rng.randbytes(2000) for _ in range(n)], pa.large_binary()),
            "width": pa.array([100 + i for i in range(n)], pa.int32()),
            "height": pa.array([80] * n, pa.int32()),
            "format": ["jpeg"] * n,
            "source": ["src"] * n,
            "caption": [f"caption {i}" for i in range(n)],
            "probe_error": pa.array([None] * n, pa.string()),
            "sha256": pa.array([None] * n, pa.string()),
        },
        schema=S.TABLE_SCHEMA,
    )
    lance.write_dataset(data, uri, max_rows_per_file=rows_per_file)


def _image_files(uri: str) -> dict[str, str]:
    """Data files holding the image column -> md5 of their bytes."""
    ds = lance.dataset(uri)
    image_field = ds.lance_schema.field("image").id()
    out = {}
    for frag in ds.get_fragments():
        for df in frag.metadata.files:
            if image_field in df.fields:
                path = os.path.join(uri, "data", df.path)
                with open(path, "rb") as f:
                    out[df.path] = hashlib.md5(f.read()).hexdigest()
    return out


def _values(uri: str, column: str) -> dict:
    t = lance.dataset(uri).to_table(columns=["id", column])
    return dict(zip(t["id"].to_pylist(), t[column].to_pylist(), strict=True))


@pytest.fixture
def table_uri(tmp_path):
    uri = str(tmp_path / "t.lance")
    _make_table(uri)
    return uri


def test_update_column_adds_column_and_leaves_image_files_untouched(table_uri):
    before = _image_files(table_uri)
    assert before, "fixture should have image data files"
    values = pa.table({"id": ["src/001", "src/005", "src/009"], "label": ["a", "b", "c"]})
    assert T.update_column(table_uri, "label", values) == 3

    ds = lance.dataset(table_uri)
    got = _values(table_uri, "label")
    assert got["src/001"] == "a" and got["src/005"] == "b" and got["src/009"] == "c"
    assert sum(v is None for v in got.values()) == 7
    # Same image data files (paths and bytes) before and after.
    assert _image_files(table_uri) == before
    # The image column still reads back identically.
    assert (
        ds.to_table(columns=["image"])["image"].to_pylist()
        == lance.dataset(table_uri, version=1).to_table(columns=["image"])["image"].to_pylist()
    )


def test_rerun_fills_only_missing_values(table_uri):
    # First (interrupted) run: only some rows got a value.
    T.update_column(
        table_uri, "hash", pa.table({"id": ["src/000", "src/002"], "hash": ["h0", "X"]})
    )
    missing = list(T.rows_missing(table_uri, "hash", ["id"], batch_size=3))
    missing_ids = [i for b in missing for i in b["id"].to_pylist()]
    assert sorted(missing_ids) == [f"src/{i:03d}" for i in range(10) if i not in (0, 2)]
    assert all(b.num_rows <= 3 for b in missing)

    # The rerun computes values only for the missing rows.
    resumed = pa.table({"id": missing_ids, "hash": [f"h{int(i[-3:])}" for i in missing_ids]})
    assert T.update_column(table_uri, "hash", resumed) == 8
    got = _values(table_uri, "hash")
    assert got["src/002"] == "X"  # written by the first run, kept
    assert got["src/007"] == "h7"
    assert list(T.rows_missing(table_uri, "hash", ["id"])) == []


def test_rows_missing_when_column_absent_and_with_filter(table_uri):
    rows = [
        i
        for b in T.rows_missing(table_uri, "not_yet", ["id", "width"])
        for i in b["id"].to_pylist()
    ]
    assert len(rows) == 10
    rows = list(T.rows_missing(table_uri, "not_yet", ["id"], filter="width >= 107"))
    assert sorted(i for b in rows for i in b["id"].to_pylist()) == ["src/007", "src/008", "src/009"]
    with pytest.raises(ValueError, match="no columns"):
        list(T.rows_missing(table_uri, "x", ["nope"]))


def test_update_existing_column_changes_only_named_rows(table_uri):
    before = _image_files(table_uri)
    n = T.update_column(
        table_uri,
        "caption",
        pa.table({"id": ["src/003", "src/003", "not/there"], "caption": ["old", "new", "zzz"]}),
    )
    assert n == 1  # the unknown key is ignored, the duplicate key counts once
    caps = _values(table_uri, "caption")
    assert caps["src/003"] == "new"  # last value wins
    assert caps["src/004"] == "caption 4"
    assert len(caps) == 10
    assert _image_files(table_uri) == before


def test_update_embedding_column_and_type_checks(table_uri):
    vec_type = pa.list_(pa.float32(), 4)
    values = pa.table(
        {
            "id": ["src/000", "src/008"],
            "embedding": pa.array([[1, 0, 0, 0], [0, 1, 0, 0]], vec_type),
        }
    )
    assert T.update_column(table_uri, "embedding", values) == 2
    ds = lance.dataset(table_uri)
    assert ds.schema.field("embedding").type == vec_type
    emb = _values(table_uri, "embedding")
    assert emb["src/008"] == [0, 1, 0, 0] and emb["src/001"] is None

    with pytest.raises(ValueError, match="do not fit"):
        T.update_column(table_uri, "width", pa.table({"id": ["src/000"], "width": ["wide"]}))
    with pytest.raises(ValueError, match="must have columns"):
        T.update_column(table_uri, "label", pa.table({"id": ["src/000"]}))
    with pytest.raises(ValueError, match="image"):
        T.update_column(table_uri, "image", pa.table({"id": ["src/000"], "image": [b"x"]}))
    with pytest.raises(FileNotFoundError):
        T.update_column(table_uri + "_nope", "label", pa.table({"id": ["a"], "label": ["b"]}))


def test_compact_and_stats(table_uri):
    stats = T.table_stats(table_uri)
    assert stats["rows"] == 10
    assert stats["fragments"] == 3  # 4 + 4 + 2 rows
    assert [f["rows"] for f in stats["fragment_sizes"]] == [4, 4, 2]
    assert all(f["bytes"] > 4 * 2000 * 0.5 for f in stats["fragment_sizes"][:2])
    assert "fragments 3" in T.format_stats(stats)
    assert "deleted" not in T.format_stats(stats)
    lance.dataset(table_uri).delete("id = 'src/000'")
    assert "1 deleted rows still stored" in T.format_stats(T.table_stats(table_uri))

    result = T.compact(table_uri, target_rows_per_fragment=100, cleanup=True)
    assert result["fragments_before"] == 3 and result["fragments_after"] == 1
    after = T.table_stats(table_uri)
    assert after["rows"] == 9 and after["fragments"] == 1
    assert "deleted" not in T.format_stats(after)  # nothing left for a compaction to do
    ids = sorted(lance.dataset(table_uri).to_table(columns=["id"])["id"].to_pylist())
    assert ids == [f"src/{i:03d}" for i in range(1, 10)]


def test_table_cli(table_uri, capsys):
    assert table_cli.main(["stats", table_uri]) == 0
    assert "fragments 3" in capsys.readouterr().out
    assert table_cli.main(["compact", table_uri, "--target-rows", "100"]) == 0
    assert '"fragments_after": 1' in capsys.readouterr().out
