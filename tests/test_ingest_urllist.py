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
    assert sorted(rows) == ["cc12m/0", "cc12m/1", "cc12m/3", "cc12m/5"]
    assert rows["cc12m/1"]["caption"] == '12" "vinyl'  # TSV does not quote
    assert rows["cc12m/0"]["url"] == "http://a/1.jpg"
    assert all(r["probe_error"] == "missing_image" and r["image"] is None for r in rows.values())
    assert rows["cc12m/5"]["caption"] is None
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
        "URL": "string",
        "similarity": "double",
        "width_src": "int64",
        "sha256": "string",
    }
    a = rows["laion/0"]
    assert (a["URL"], a["caption"], a["similarity"], a["width_src"]) == (
        "http://x/1",
        "a, cat",
        0.31,
        640,
    )
    assert a["sha256"] == "aa"
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
    assert rows["o/3"]["link"] == "http://x/9" and rows["o/3"]["score"] is None
    assert rows["o/0"]["caption"] == "d0" and rows["o/2"]["score"] == 2
    assert counts["kept:bad_value:score"] == 1


def test_txt_and_json_lines(tmp_path):
    txt = _write(tmp_path / "urls.txt", "http://x/1\nhttp://x/2\n  \nhttp://x/3")
    assert detect_format(txt) == "txt"
    _, rows, _ = _load_all(SourceSpec(txt), items_per_unit=2)
    assert {k: r["url"] for k, r in rows.items()} == {
        "urls/0": "http://x/1",
        "urls/1": "http://x/2",
        "urls/3": "http://x/3",
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
    assert sorted(rows) == ["dc/u1", "dc/u2"]
    assert rows["dc/u1"]["tags"] == [1, 2] and rows["dc/u2"]["sha256"] == "cd"
    assert json.loads(rows["dc/u2"]["meta"]) == {"a": 1}
    assert counts["dropped:bad_json_line"] == 1 and counts["dropped:no_url"] == 1
    array = _write(tmp_path / "arr.json", json.dumps([{"url": "http://x"}]))
    with pytest.raises(UsageError, match="jq -c"):
        plan_source(SourceSpec(array))


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
    assert sorted(r["id"] for r in t) == sorted(f"cc12m/{i}" for i in range(30))
    assert {r["id"]: r["caption"] for r in t}["cc12m/7"] == "caption 7"
    # A second ingest of the same list adds nothing: the ids are stable.
    assert main([path, "--table", uri, "--no-progress"]) == 0
    assert lance.dataset(uri).count_rows() == 30


def test_a_line_that_is_not_utf8_is_kept_and_noted_on_its_own_row(tmp_path):
    path = tmp_path / "l.tsv"
    path.write_bytes(b"url\tcaption\nhttp://x/1\tok\nhttp://x/2\tcaf\xe9\n")
    _, rows, counts = _load_all(SourceSpec(str(path)))
    assert rows["l/1"]["caption"] == "caf\ufffd" and "line_not_utf8" in rows["l/1"]["__notes"]
    assert "line_not_utf8" not in rows["l/0"]["__notes"]
    assert counts["kept:line_not_utf8"] == 1 and counts["kept:probe_error:missing_image"] == 2
