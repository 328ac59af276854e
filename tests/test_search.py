"""Descriptors, full-text/vector/hybrid search and facet filters on a small real table."""

from __future__ import annotations

import random

import lance
import numpy as np
import pyarrow as pa
import pytest

from prx_data.cli import search as search_cli
from prx_data.columns import descriptors
from prx_data.core import descriptor
from prx_data.core.buckets import assign_bucket
from prx_data.core.runtime import RunOptions
from prx_data.table import lance_ops as T
from prx_data.table import search
from tests.ingest_data import jpeg
from tests.tablekit import make_table

COLOURS = {"red": (210, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 210)}


def _noisy_jpeg(colour, seed: int, w=96, h=64) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.array(colour, np.float32)[None, None, :]
    px = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def table_uri(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("search") / "t.lance")
    items = []
    for name, colour in COLOURS.items():
        for i in range(4):
            items.append(
                (
                    f"t/{name}{i}",
                    _noisy_jpeg(colour, hash((name, i)) % 1000),
                    f"a {name} square number {i}",
                )
            )
    items.append(("t/broken", b"not an image", "a broken red file"))
    make_table(uri, items, max_rows_per_file=5)
    assert descriptors.compute_descriptors(
        uri,
        chunk_rows=4,
        run=RunOptions(progress=False),
    ) == len(items)
    search.build_indexes(uri)
    return uri


def test_descriptor_shape_and_similarity():
    a = descriptor.describe(_noisy_jpeg(COLOURS["red"], 1))
    b = descriptor.describe(_noisy_jpeg(COLOURS["red"], 2, w=120, h=80))
    c = descriptor.describe(_noisy_jpeg(COLOURS["blue"], 3))
    assert a.shape == (descriptor.DIM,) and a.dtype == np.float32
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    assert float(a @ b) > float(a @ c) + 0.3
    assert descriptor.describe(b"\x00" * 10) is None
    col = descriptor.describe_many([jpeg(20, 20), None, b"bad"])
    assert col.type == descriptor.VECTOR_TYPE and col.null_count == 2


def test_descriptors_are_resumable(table_uri):
    ds = lance.dataset(table_uri)
    assert ds.count_rows(f"{descriptor.COLUMN} IS NULL") == 1  # only the broken image
    # A rerun only revisits the row still missing (and leaves the others alone).
    before = ds.to_table(columns=["id", descriptor.COLUMN]).to_pylist()
    assert (
        descriptors.compute_descriptors(
            table_uri,
            run=RunOptions(progress=False),
        )
        == 1
    )
    after = lance.dataset(table_uri).to_table(columns=["id", descriptor.COLUMN]).to_pylist()
    assert before == after


def test_caption_columns_skip_bookkeeping_columns():
    names = ["caption", "caption_vlm", "caption_vlm_status", "caption_vlm_error", "alt_caption"]
    assert [n for n in names if search.is_caption_column(n)] == [
        "caption",
        "caption_vlm",
        "alt_caption",
    ]
    assert not search.is_caption_column("source_file")


def test_text_search_and_filters(table_uri):
    assert search.caption_columns(table_uri) == ["caption"]
    hits = search.text_search(table_uri, "green", k=10)
    assert sorted(hits["id"].to_pylist()) == [f"t/green{i}" for i in range(4)]
    assert "_score" in hits.column_names
    hits = search.text_search(table_uri, "red", k=10, filter="id != 't/broken'")
    assert sorted(hits["id"].to_pylist()) == [f"t/red{i}" for i in range(4)]
    assert search.text_search(table_uri, "   ").num_rows == 0


def test_similar_finds_same_colour(table_uri):
    assert search.vector_column(table_uri) == descriptor.COLUMN
    res = search.similar(table_uri, "t/blue0", k=3)
    assert "t/blue0" not in res["id"].to_pylist()
    assert sorted(res["id"].to_pylist()) == ["t/blue1", "t/blue2", "t/blue3"]
    assert list(res["_distance"].to_pylist()) == sorted(res["_distance"].to_pylist())
    with pytest.raises(KeyError):
        search.similar(table_uri, "t/broken")


def test_rrf_and_hybrid(table_uri):
    fused = search.rrf([["a", "b", "c"], ["c", "a", "d"]], k=60)
    assert [i for i, _ in fused] == ["a", "c", "b", "d"]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)

    res = search.hybrid_search(table_uri, "red number 1", k=6)
    ids = res["id"].to_pylist()
    assert ids[0] == "t/red1"  # best in both lists
    # The vector list (from the top text hits) brings the other red squares in.
    assert {"t/red0", "t/red2", "t/red3"} <= set(ids)
    assert res["text_rank"][0].as_py() == 1


def test_ann_index_used_when_large_enough(tmp_path):
    uri = str(tmp_path / "v.lance")
    rng = np.random.default_rng(0)
    n, dim = 600, 16
    vecs = rng.normal(size=(n, dim)).astype(np.float32)
    lance.write_dataset(
        pa.table(
            {
                "id": [f"v/{i}" for i in range(n)],
                "caption": [f"item {i}" for i in range(n)],
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), dim),
            }
        ),
        uri,
    )
    made = search.build_indexes(uri, min_rows_for_ann=500, vector_index="IVF_PQ")
    assert made == {"caption": "INVERTED", "id": "BTREE", "embedding": "IVF_PQ"}
    assert {i["type"] for i in lance.dataset(uri).list_indices()} >= {"IVF_PQ", "Inverted"}
    res = search.vector_search(uri, vecs[42], k=5, nprobes=24, refine_factor=10)
    assert res["id"][0].as_py() == "v/42"


def test_filter_sql_matches_bucket_assignment(tmp_path):
    rnd = random.Random(1)
    sizes = [(rnd.randint(100, 5000), rnd.randint(100, 5000)) for _ in range(400)]
    sizes += [(384, 384), (383, 384), (768, 768), (1000, 2000), (2001, 1000), (352, 704)]
    uri = str(tmp_path / "f.lance")
    lance.write_dataset(
        pa.table(
            {
                "id": [f"f/{i}" for i in range(len(sizes))],
                "width": pa.array([w for w, _ in sizes], pa.int32()),
                "height": pa.array([h for _, h in sizes], pa.int32()),
                "label": ["a" if i % 3 else "b" for i in range(len(sizes))],
            }
        ),
        uri,
    )
    ds = lance.dataset(uri)

    def ids(where):
        return set(ds.to_table(columns=["id"], filter=where)["id"].to_pylist())

    expected_tier: dict = {}
    expected_ar: dict = {}
    for i, (w, h) in enumerate(sizes):
        a = assign_bucket(w, h)
        expected_tier.setdefault(a.bucket.tier if a.bucket else a.reason, set()).add(f"f/{i}")
        if a.bucket:
            expected_ar.setdefault(a.bucket.name.split("/")[1], set()).add(f"f/{i}")
    for tier in (512, 1024, 2048, 4096):
        got = ids(search.filter_sql(tier=tier))
        want = expected_tier.get(tier, set())
        # aspect_ratio drops still have a tier by size; the tier filter is about size only.
        size_only = {f"f/{i}" for i, (w, h) in enumerate(sizes) if _tier_by_size(w, h) == tier}
        assert want <= got == size_only
    assert ids(search.filter_sql(tier="too_small")) == expected_tier.get("too_small", set())
    for label, want in expected_ar.items():
        got = ids(search.filter_sql(aspect=label))
        in_range = {i for i in got if i not in expected_tier.get("too_small", set())}
        assert in_range == want, label
    oor = ids(search.filter_sql(aspect="out_of_range"))
    assert oor == {f"f/{i}" for i, (w, h) in enumerate(sizes) if not 0.5 <= w / h <= 2.0}
    both = ids(search.filter_sql(tier=1024, labels={"label": "b"}))
    assert both and all(int(i[2:]) % 3 == 0 for i in both)
    with pytest.raises(ValueError):
        search.filter_sql(aspect="3.000")


def _tier_by_size(w, h):
    from prx_data.core.buckets import assign_tier

    return assign_tier(w, h)


def test_update_column_keeps_index_queries_working(table_uri):
    # Adding a label column after indexing must not break search.
    T.update_column(table_uri, "label", pa.table({"id": ["t/red0"], "label": ["x"]}))
    hits = search.text_search(table_uri, "red", k=10, filter="label = 'x'")
    assert hits["id"].to_pylist() == ["t/red0"]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_descriptors_with_ray_match_the_local_path(tmp_path):
    items = [(f"r/{i}", _noisy_jpeg(COLOURS["red"], i), None) for i in range(6)] + [
        ("r/x", b"x", None)
    ]
    a, b = str(tmp_path / "a.lance"), str(tmp_path / "b.lance")
    make_table(a, items, max_rows_per_file=3)
    make_table(b, items, max_rows_per_file=3)
    assert (
        descriptors.compute_descriptors(
            a,
            run=RunOptions(progress=False),
        )
        == 7
    )
    assert (
        descriptors.compute_descriptors(
            b,
            run=RunOptions(engine="ray", progress=False),
            chunk_rows=4,
        )
        == 7
    )
    va = lance.dataset(a).to_table(columns=["id", descriptor.COLUMN]).sort_by("id")
    vb = lance.dataset(b).to_table(columns=["id", descriptor.COLUMN]).sort_by("id")
    assert va.equals(vb)
    assert va[descriptor.COLUMN].null_count == 1


def test_search_cli(table_uri, capsys):
    assert search_cli.main(["--table", table_uri, "blue", "--k", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and all("id=t/blue" in line for line in out)
    assert search_cli.main(["--table", table_uri, "--similar", "t/green1", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("id=t/green") == 3 and "t/green1 " not in out
