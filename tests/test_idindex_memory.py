"""The id index keeps a lookup's and a build's memory bounded, whatever the table's size.

A lookup opens the index with small Lance caches and queries the BTREE in sorted
slices of ``IN_CHUNK`` ids (so only one slice's pages are read at a time); the
build writes one BTREE segment per data file. Both must give exactly the rows a
full read of the table gives.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prx_data.export import idindex as I
from prx_data.export import layout
from tests.exportkit import make_export

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("idxmem") / "ex")
    return make_export(root, {B1: 25, B2: 14}, samples_per_part=6, samples_per_shard=4)


def _rows(tables) -> list[tuple]:
    return sorted(
        r
        for t in tables
        for r in zip(*(t[c].to_pylist() for c in ("id", "bucket", "shard", "index")), strict=True)
    )


class _Spy:
    """The index's Lance table, recording which of ``candidates`` each query asked for."""

    def __init__(self, ds, candidates: pa.Array) -> None:
        self.ds, self.candidates, self.queries = ds, pa.table({"id": candidates}), []

    def to_table(self, *, columns, filter):  # noqa: A002  (Lance's keyword)
        self.queries.append(self.candidates.filter(filter)["id"].to_pylist())
        return self.ds.to_table(columns=columns, filter=filter)


def test_lookup_opens_the_index_with_small_lance_caches(export, monkeypatch):
    from prx_data.table import lance_ops

    seen = {}
    real = lance_ops.open_table

    def spy(uri, storage_options=None, version=None, **options):
        if uri == I.index_uri(export.root):
            seen.update(options)
        return real(uri, storage_options, version, **options)

    monkeypatch.setattr(lance_ops, "open_table", spy)
    index, why = I.open_index(export.root)
    assert index is not None, why
    assert 0 < seen["index_cache_size_bytes"] <= 8 << 20
    assert 0 < seen["metadata_cache_size_bytes"] <= 8 << 20


def test_sorted_chunked_lookup_returns_exactly_the_rows_of_a_full_read(export, monkeypatch):
    index, _ = I.open_index(export.root)
    present = sorted(export.where)
    # Unsorted, with duplicates, absent ids (one sorting between present ones) and a null.
    wanted = [present[30], "zz/absent", present[3], present[30], f"ds/{B1}/10x", present[0]]
    wanted += present[::-5] + [None, present[3]]
    monkeypatch.setattr(I, "IN_CHUNK", 3)
    monkeypatch.setattr(I, "SCAN_RATIO", 0)  # the BTREE path, whatever the share
    spy = _Spy(index.dataset, pa.array(sorted({w for w in wanted if w}), pa.string()))
    index.dataset = spy
    got = _rows(index.lookup(pa.array(wanted, pa.string())))
    full = index.dataset.ds.to_table()
    expect = _rows([full.filter(pc.is_in(full["id"], value_set=pa.array(wanted, pa.string())))])
    assert got == expect and len(got) == len({w for w in wanted if w in export.where})
    asked = [i for q in spy.queries for i in q]
    assert all(0 < len(q) <= 3 for q in spy.queries)
    assert asked == sorted(set(asked)), "each id once, in sorted order across the queries"
    assert set(asked) == {w for w in wanted if w}


def test_the_btree_is_built_one_segment_per_data_file(tmp_path, export, monkeypatch):
    import shutil

    root = str(tmp_path / "ex")
    shutil.copytree(export.root, root)
    monkeypatch.setattr(I, "ROWS_PER_FILE", 8)
    info = I.write_id_index(root)
    index, why = I.open_index(root)
    assert index is not None, why
    frags = index.dataset.get_fragments()
    segments = [i for i in index.dataset.list_indices() if i["fields"] == ["id"]]
    assert len(frags) == -(-info.rows // 8) > 1
    assert len(segments) == len(frags) and {s["type"] for s in segments} == {"BTree"}
    assert sorted(f for s in segments for f in s["fragment_ids"]) == sorted(
        f.fragment_id for f in frags
    )
    monkeypatch.setattr(I, "SCAN_RATIO", 0)
    wanted = pa.array(sorted(export.where)[::3] + ["absent"], pa.string())
    got = _rows(index.lookup(wanted))
    assert got == sorted((i, *export.where[i]) for i in wanted.to_pylist() if i in export.where)
    assert _rows([index.dataset.to_table()]) == _rows([layout.read_manifests(root)])


def test_a_query_spans_about_query_pages_btree_pages_whatever_the_table_size():
    pages, per_page = I.QUERY_PAGES, I.BTREE_PAGE_ROWS

    def spanned(ids: int, rows: int) -> float:  # pages a slice of a spread request covers
        k = I.slice_ids(ids, rows)
        return min(k, k * rows / ids / per_page)

    # Sparse requests (ids further apart than a page): a page per id, at every size.
    assert I.slice_ids(10**4, 10**8) == I.slice_ids(10**4, 10**9) == pages
    # Denser ones take more ids per query, for about the same pages.
    for ids, rows in ((10**4, 10**7), (10**5, 10**7), (10**6, 10**8)):
        assert I.slice_ids(ids, rows) > pages
        assert pages - 1 <= spanned(ids, rows) <= pages
    assert I.slice_ids(10**6, 10**6) == I.IN_CHUNK  # capped
