"""URL lists (txt, csv, tsv, JSON lines) become URL rows with stable ids, streamed in units."""

from __future__ import annotations

import json

import lance
import pytest

from prx_data.core.errors import UsageError
from prx_data.ingest import Counts, SourceSpec, detect_format, load_unit, plan_source
from prx_data.ingest.urllist import _cut


def _load_all(spec: SourceSpec, **options):
    plan = plan_source(spec, **options)
    counts = Counts(plan.counts)
    rows = {}
    for unit in plan.units:
        t = load_unit(unit, counts)
        counts.tally_notes(t["__notes"].to_pylist())
        for r in t.to_pylist():
            assert r["id"] not in rows
            rows[r["id"]] = r
    return plan, rows, counts


def _write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_headerless_tsv_like_cc12m_keeps_line_numbers_as_ids(tmp_path):
    path = _write(
        tmp_path / "cc12m.tsv",
        'http://a/1.jpg\ta cat\nhttp://a/2.jpg\t12" "vinyl\n\nhttp://a/3.jpg\tthird\nbroken\n'
        "http://a/5.jpg\t\n",
    )
    assert detect_format(path) == "tsv"
    plan, rows, counts = _load_all(SourceSpec(path), items_per_unit=2)
    assert len(plan.units) == 3  # 6 lines, 2 per unit
    assert sorted(rows) == ["cc12m.tsv/0", "cc12m.tsv/1", "cc12m.tsv/3", "cc12m.tsv/5"]
    assert rows["cc12m.tsv/1"]["caption"] == '12" "vinyl'  # TSV does not quote
    assert rows["cc12m.tsv/0"]["url"] == "http://a/1.jpg"
    assert all(r["probe_error"] == "missing_image" and r["image"] is None for r in rows.values())
    assert rows["cc12m.tsv/5"]["caption"] is None
    assert counts["dropped:blank_line"] == 1 and counts["dropped:bad_row"] == 1
    assert counts["kept:caption_missing"] == 1
    # Ids do not depend on how the file is cut.
    _, again, _ = _load_all(SourceSpec(path), items_per_unit=1000)
    assert again == rows


def test_csv_with_header_types_and_named_columns(tmp_path, monkeypatch):
    import prx_data.ingest.urllist as U

    path = _write(
        tmp_path / "laion.csv",
        'URL,TEXT,similarity,width_src,sha256\nhttp://x/1,"a, cat",0.31,640,aa\n'
        "http://x/2,dog,0.29,800,bb\n",
    )
    plan, rows, counts = _load_all(SourceSpec(path))
    types = {f.name: str(f.type) for f in plan.extra_fields}
    assert types == {
        "url": "string",
        "similarity": "double",
        "width_src": "int64",
        "src_sha256": "string",  # the table's sha256 is the digest of the bytes it holds
    }
    a = rows["laion.csv/0"]
    assert (a["url"], a["caption"], a["similarity"], a["width_src"]) == (
        "http://x/1",
        "a, cat",
        0.31,
        640,
    )
    assert a["src_sha256"] == "aa"
    # Named columns; a value that does not fit the column's type is null and counted.
    other = _write(
        tmp_path / "o.csv",
        "link,desc,score\n"
        + "".join(f"http://x/{i},d{i},{i}\n" for i in range(3))
        + "http://x/9,d9,n/a\n",
    )
    monkeypatch.setattr(U, "SAMPLE_LINES", 3)  # the types come from the first lines only
    with pytest.raises(UsageError, match="no URL column"):
        plan_source(SourceSpec(other))
    with pytest.raises(UsageError, match="'nope' is not in"):
        plan_source(SourceSpec(other), url_column="nope")
    _, rows, counts = _load_all(
        SourceSpec(other), url_column="link", caption_column="desc", items_per_unit=2
    )
    assert rows["o.csv/3"]["url"] == "http://x/9" and rows["o.csv/3"]["score"] is None
    assert rows["o.csv/0"]["caption"] == "d0" and rows["o.csv/2"]["score"] == 2
    assert counts["kept:bad_value:score"] == 1


def test_txt_and_json_lines(tmp_path):
    txt = _write(tmp_path / "urls.txt", "http://x/1\nhttp://x/2\n  \nhttp://x/3")
    assert detect_format(txt) == "txt"
    _, rows, _ = _load_all(SourceSpec(txt), items_per_unit=2)
    assert {k: r["url"] for k, r in rows.items()} == {
        "urls.txt/0": "http://x/1",
        "urls.txt/1": "http://x/2",
        "urls.txt/3": "http://x/3",
    }
    lines = [
        {"uid": "u1", "url": "http://x/1", "caption": "one", "sha256": "ab", "tags": [1, 2]},
        "{not json",
        {"uid": "u2", "url": "http://x/2", "sha256": "cd", "tags": [3], "meta": {"a": 1}},
        {"uid": "u3", "caption": "no url"},
    ]
    jl = _write(
        tmp_path / "dc.jsonl",
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n",
    )
    plan, rows, counts = _load_all(SourceSpec(jl))
    assert sorted(rows) == ["dc.jsonl/u1", "dc.jsonl/u2"]
    assert rows["dc.jsonl/u1"]["tags"] == [1, 2] and rows["dc.jsonl/u2"]["src_sha256"] == "cd"
    assert json.loads(rows["dc.jsonl/u2"]["meta"]) == {"a": 1}
    assert counts["dropped:bad_json_line"] == 1 and counts["dropped:no_url"] == 1
    # img2dataset users also have JSON arrays: read whole (capped), the element index as key.
    array = _write(
        tmp_path / "arr.json",
        json.dumps([{"URL": "http://x/a", "TEXT": "a"}, {"URL": "http://x/b"}]),
    )
    _, rows, _ = _load_all(SourceSpec(array))
    assert {k: (r["url"], r["caption"]) for k, r in rows.items()} == {
        "arr.json/0": ("http://x/a", "a"),
        "arr.json/1": ("http://x/b", None),
    }


def test_cutting_streams_and_counts_lines(tmp_path, monkeypatch):
    import prx_data.ingest.urllist as U

    monkeypatch.setattr(U, "_BLOCK", 7)  # many blocks: boundaries fall inside and across them
    text = "".join(f"http://x/{i}\n" for i in range(23))
    path = _write(tmp_path / "u.txt", text)
    units, lines = _cut(path, 5)
    assert lines == 23 and [u[2] for u in units] == [0, 5, 10, 15, 20]
    data = text.encode()
    assert [data[a:b].count(b"\n") for a, b, _ in units] == [5, 5, 5, 5, 3]
    assert units[-1][1] == len(data) and all(units[i][1] == units[i + 1][0] for i in range(4))
    _write(tmp_path / "v.txt", text.rstrip("\n"))
    assert _cut(str(tmp_path / "v.txt"), 5)[1] == 23


@pytest.mark.usefixtures("ray_local")
def test_ingest_cli_reads_a_tsv_and_suggests_the_download(tmp_path, capsys):
    from prx_data.cli.ingest import main

    path = _write(
        tmp_path / "cc12m.tsv",
        "".join(f"http://127.0.0.1:9/{i}.jpg\tcaption {i}\n" for i in range(30)),
    )
    uri = str(tmp_path / "t.lance")
    assert main([path, "--table", uri, "--items-per-unit", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "next: python -m prx_data.download --table" in out
    t = lance.dataset(uri).to_table(columns=["id", "url", "caption"]).to_pylist()
    assert sorted(r["id"] for r in t) == sorted(f"cc12m.tsv/{i}" for i in range(30))
    assert {r["id"]: r["caption"] for r in t}["cc12m.tsv/7"] == "caption 7"
    # A second ingest of the same list adds nothing: the ids are stable.
    assert main([path, "--table", uri, "--no-progress"]) == 0
    assert lance.dataset(uri).count_rows() == 30


def test_a_line_that_is_not_utf8_is_kept_and_noted_on_its_own_row(tmp_path):
    path = tmp_path / "l.tsv"
    path.write_bytes(b"url\tcaption\nhttp://x/1\tok\nhttp://x/2\tcaf\xe9\n")
    _, rows, counts = _load_all(SourceSpec(str(path)))
    assert (
        rows["l.tsv/1"]["caption"] == "caf\ufffd" and "line_not_utf8" in rows["l.tsv/1"]["__notes"]
    )
    assert "line_not_utf8" not in rows["l.tsv/0"]["__notes"]
    assert counts["kept:line_not_utf8"] == 1 and counts["kept:probe_error:missing_image"] == 2


# --- lists as img2dataset users have them ---------------------------------------------------


def _compress(data: bytes, codec: str) -> bytes:
    import bz2
    import gzip

    if codec == "gzip":
        return gzip.compress(data)
    if codec == "bz2":
        return bz2.compress(data)
    import pyarrow as pa  # zstd through pyarrow (no zstandard package needed)

    out = pa.BufferOutputStream()
    with pa.CompressedOutputStream(out, "zstd") as f:
        f.write(data)
    return out.getvalue().to_pybytes()


@pytest.mark.parametrize(("suffix", "codec"), [(".gz", "gzip"), (".bz2", "bz2"), (".zst", "zstd")])
def test_compressed_lists_are_read_not_stored_as_urls(tmp_path, monkeypatch, suffix, codec):
    import prx_data.ingest.urllist as U

    monkeypatch.setattr(U, "_BLOCK", 64)  # ranges that start deep inside the stream
    text = "url\tcaption\n" + "".join(f"http://x/{i}.jpg\tcap {i}\n" for i in range(40))
    path = tmp_path / f"cc.tsv{suffix}"
    path.write_bytes(_compress(text.encode(), codec))
    assert detect_format(str(path)) == "tsv"
    plan, rows, _ = _load_all(SourceSpec(str(path)), items_per_unit=3)
    # Each unit decompresses from the start: their number is capped.
    assert 1 < len(plan.units) <= U.COMPRESSED_UNITS
    assert sorted(rows) == sorted(f"cc.tsv/{i}" for i in range(40))
    assert rows["cc.tsv/39"]["url"] == "http://x/39.jpg"
    assert rows["cc.tsv/39"]["caption"] == "cap 39"
    # A gzip file named .tsv (the old advice: --format tsv) is found by its first bytes.
    lying = tmp_path / "named.tsv"
    lying.write_bytes(_compress(text.encode(), codec))
    _, rows, _ = _load_all(SourceSpec(str(lying), fmt="tsv"))
    assert all(r["url"].startswith("http://x/") for r in rows.values()) and len(rows) == 40


def test_lists_with_one_stem_keep_their_rows_and_a_folder_of_lists_is_read(tmp_path):
    from prx_data.pipelines.ingest import ingest

    (tmp_path / "urls.txt").write_text("".join(f"http://x/t{i}\n" for i in range(13)))
    (tmp_path / "urls.csv").write_text(
        "URL,TEXT,LICENSE\n" + "".join(f"http://x/c{i},c {i},cc-by\n" for i in range(13))
    )
    uri = str(tmp_path / "t.lance")
    report = ingest(
        [str(tmp_path / "urls.txt"), str(tmp_path / "urls.csv")],
        uri,
        engine="local",
        progress=False,
    )
    assert report.rows_written == 26
    t = lance.dataset(uri).to_table().to_pylist()
    by_id = {r["id"]: r for r in t}
    assert (
        by_id["urls.csv/3"]["url"] == "http://x/c3" and by_id["urls.txt/3"]["url"] == "http://x/t3"
    )
    assert by_id["urls.csv/3"]["caption"] == "c 3" and by_id["urls.csv/3"]["license"] == "cc-by"
    assert "URL" not in lance.dataset(uri).schema.names

    lists = tmp_path / "lists"
    (lists / "more").mkdir(parents=True)
    (lists / "a.tsv").write_text("http://x/a0\tA\nhttp://x/a1\tB\n")
    (lists / "more" / "b.jsonl.gz").write_bytes(
        _compress(b'{"url": "http://x/b0"}\n{"url": "http://x/b1"}\n', "gzip")
    )
    assert detect_format(str(lists)) == "urllists"
    _, rows, _ = _load_all(SourceSpec(str(lists)))
    assert {k: r["url"] for k, r in rows.items()} == {
        "lists/a.tsv/0": "http://x/a0",
        "lists/a.tsv/1": "http://x/a1",
        "lists/more/b.jsonl/0": "http://x/b0",
        "lists/more/b.jsonl/1": "http://x/b1",
    }


def test_img2dataset_flag_spellings_and_case_insensitive_names(tmp_path):
    from prx_data.cli.ingest import build_parser

    args = build_parser().parse_args(
        ["x.csv", "--table", "t", "--url-col", "Link", "--caption-col", "Desc"]
    )
    assert (args.url_column, args.caption_column) == ("Link", "Desc")
    path = _write(tmp_path / "o.csv", "LINK,DESC\nhttp://x/1,one\n")
    _, rows, _ = _load_all(SourceSpec(path), url_column="link", caption_column="desc")
    assert (rows["o.csv/0"]["url"], rows["o.csv/0"]["caption"]) == ("http://x/1", "one")


def test_laion_parquet_columns_are_lower_cased(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "laion.parquet")
    pq.write_table(
        pa.table(
            {
                "URL": ["http://x/1"],
                "TEXT": ["a cat"],
                "LICENSE": ["cc0"],
                "WIDTH": [640],
                "aestheticScore": [5.0],
            }
        ),
        path,
    )
    plan, rows, _ = _load_all(SourceSpec(path))
    assert {f.name for f in plan.extra_fields} == {"url", "license", "src_width", "aestheticScore"}
    (r,) = rows.values()
    assert (r["url"], r["caption"], r["license"], r["src_width"]) == (
        "http://x/1",
        "a cat",
        "cc0",
        640,
    )
