"""Explorer HTTP API: search, similar, thumbnails, filters, escaping and binding."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from prx_data.cli import explore as explore_cli
from prx_data.explore import app as explore
from tests.explore_kit import XSS_CAPTION, make_enriched_table, make_explore_table, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("explore") / "t.lance")
    make_explore_table(uri)
    with running_server(uri) as (url, srv):
        yield url, srv


def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def api(base: str, path: str, **params) -> dict:
    status, _, body = get(f"{base}{path}?{urllib.parse.urlencode(params)}")
    assert status == 200, body
    return json.loads(body)


def test_binds_to_loopback_and_prepares_table(server):
    url, srv = server
    assert srv.server_address[0] == "127.0.0.1"
    assert explore.ExploreConfig(table="x").host == "127.0.0.1"
    meta = api(url, "/api/meta")
    assert meta["rows"] == 14 and meta["text_columns"] == ["caption"]
    assert meta["vector_column"] == "pixel_descriptor"  # computed at start (small table)
    assert "512" in meta["tiers"] and "1.000" in meta["aspects"]
    assert meta["labels"].get("format") == ["jpeg"]


def test_search_browse_and_filters(server):
    url, _ = server
    res = api(url, "/api/search", q="green")
    assert res["mode"] == "text"
    assert sorted(r["id"] for r in res["results"]) == [f"t/green{i}" for i in range(4)]
    browse = api(url, "/api/search")
    assert browse["mode"] == "browse" and len(browse["results"]) == 14
    # 64x64 images: too small for any tier; 96x64 is aspect 1.5 -> nearest shape 1.462.
    small = api(url, "/api/search", tier="too_small")
    assert len(small["results"]) == 13  # every readable image here is tiny
    wide = api(url, "/api/search", q="square", aspect="1.462")
    assert sorted(r["id"] for r in wide["results"]) == sorted(
        f"t/{c}{i}" for c in ("red", "green", "blue") for i in (1, 3)
    )
    labelled = api(url, "/api/search", **{"label.format": "png"})
    assert labelled["results"] == []
    status, _, body = get(f"{url}/api/search?aspect=9.999")
    assert status == 400 and b"unknown aspect" in body


def test_similar_and_thumbnails(server):
    url, _ = server
    res = api(url, "/api/similar", id="t/red0", k=3)
    assert sorted(r["id"] for r in res["results"]) == ["t/red1", "t/red2", "t/red3"]
    assert api(url, "/api/similar", id="t/broken")["results"] == []
    status, headers, body = get(f"{url}/api/thumb?id=t%2Fred0&size=64")
    assert status == 200 and headers["Content-Type"] == "image/jpeg" and body[:2] == b"\xff\xd8"
    status, headers, body = get(f"{url}/api/thumb?id=t%2Fbroken")
    assert status == 200 and headers["Content-Type"] == "image/png"  # placeholder
    row = api(url, "/api/row", id="t/blue1")
    assert row["caption"] == "a blue square 1" and "image" not in row


def test_captions_are_data_never_markup(server):
    url, _ = server
    res = api(url, "/api/search", q="evil")
    assert [r["caption"] for r in res["results"]] == [XSS_CAPTION]  # JSON, not HTML
    status, headers, page = get(url + "/")
    assert status == 200
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert b"<script>" not in page and b"evil" not in page  # no inline script, no table data
    _, _, js = get(url + "/static/app.js")
    assert b"innerHTML" not in js and b"textContent" in js
    assert get(url + "/static/..%2Fexplore.py")[0] == 404
    assert get(url + "/nope")[0] == 404


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit):
        explore_cli.main(["--help"])
    out = capsys.readouterr().out
    for opt in ("--table", "--host", "--port", "--descriptors", "--no-index", "127.0.0.1"):
        assert opt in out


def test_explorer_follows_new_columns(tmp_path):
    import pyarrow as pa

    from prx_data.table.lance_ops import update_column

    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    app = explore.Explorer(explore.ExploreConfig(table=uri))
    assert "quality" not in app.meta()["labels"]
    update_column(
        uri, "quality", pa.table({"id": ["t/red0", "t/blue2"], "quality": ["good", "bad"]})
    )
    app.refresh(min_interval_s=0)
    assert app.meta()["labels"]["quality"] == ["bad", "good"]
    res = app.search({"label.quality": "good"})
    assert [r["id"] for r in res["results"]] == ["t/red0"]


def test_cards_carry_captions_labels_duplicates_and_quality(tmp_path):
    app = explore.Explorer(
        explore.ExploreConfig(table=make_enriched_table(str(tmp_path / "rich.lance")))
    )
    try:
        meta = app.meta()
        # Status columns are neither captions nor searchable text.
        assert meta["caption_columns"] == ["caption", "caption_vlm"]
        assert meta["text_columns"] == ["caption", "caption_vlm"]
        assert "dup_of" in meta["fields"] and "dup_of" not in meta["labels"]
        assert meta["fields"][0] == "id" and meta["quality"] == ["low", "ok", "unmeasured"]
        (red1,) = [r for r in app.search({"q": "t/red1"})["results"] if r["id"] == "t/red1"]
        assert red1["captions"] == {
            "caption": "a red square 1",
            "caption_vlm": "vlm says t/red1 crimson",
        }
        assert red1["labels"]["label"] == "visual" and red1["dup_of"] == "t/red0"
        assert "caption_vlm_status" not in red1["labels"]  # one value everywhere: not on cards
        assert red1["quality"]["std"] > 5 and red1["low_information"] is False
        # The VLM caption is searchable; the status column is not.
        hits = app.search({"q": "crimson", "k": "50"})["results"]
        assert len(hits) == 12
        assert app.search({"q": "ok"})["results"] == []
        # Typed fields: exact dup_of, id prefix; quality filter.
        dups = app.search({"field.dup_of": "t/red0"})["results"]
        assert sorted(r["id"] for r in dups) == ["t/red1", "t/red2"]
        greens = app.search({"field.id": "t/green"})["results"]
        assert sorted(r["id"] for r in greens) == [f"t/green{i}" for i in range(4)]
        assert app.search({"quality": "unmeasured"})["results"][0]["id"] == "t/broken"
        low = app.search({"quality": "low"})["results"]
        assert [(r["id"], r["low_information"]) for r in low] == [("t/overlay", True)]
        with pytest.raises(ValueError, match="quality"):
            app.search({"quality": "shiny"})
    finally:
        app.close()


def test_id_search_and_paging(server):
    url, _ = server
    res = api(url, "/api/search", q="t/blue2")
    assert [r["id"] for r in res["results"]] == ["t/blue2"] and res["mode"] == "id"
    assert res["next_offset"] is None
    assert api(url, "/api/search", q="t/nope")["results"] == []
    seen = []
    offset = 0
    while offset is not None:
        page = api(url, "/api/search", k=5, offset=offset)
        assert len(page["results"]) <= 5
        seen += [r["id"] for r in page["results"]]
        offset = page["next_offset"]
    assert len(seen) == 14 and len(set(seen)) == 14  # every row once, in three pages
    # Text search pages too: 12 "square" captions, pages of 5.
    first = api(url, "/api/search", q="square", k=5)
    second = api(url, "/api/search", q="square", k=5, offset=5)
    third = api(url, "/api/search", q="square", k=5, offset=10)
    ids = [r["id"] for p in (first, second, third) for r in p["results"]]
    assert len(ids) == 12 and len(set(ids)) == 12 and third["next_offset"] is None
    status, _, body = get(f"{url}/api/search?offset=x")
    assert status == 400


def test_thumbnails_are_made_ahead_off_the_request_path(tmp_path):
    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    app = explore.Explorer(explore.ExploreConfig(table=uri))
    try:
        app.search({"q": "green"})  # returns at once; the page's thumbnails are queued
        with app._lock:
            futures = {app._pending.get((f"t/green{i}", explore.THUMB_SIZE)) for i in range(4)}
        for f in futures - {None}:
            f.result(timeout=30)
        with app._lock:
            cached = {k[0] for k in app._thumbs}
        assert {f"t/green{i}" for i in range(4)} <= cached
        assert app.thumbnail("t/green0")[:2] == b"\xff\xd8"
        assert app.thumbnail("t/broken") is None and app.thumbnail("t/none") is None
    finally:
        app.close()


def test_client_disconnects_are_quiet(server, capfd):
    import socket

    url, _ = server
    host, port = url.rsplit("//", 1)[1].split(":")
    for _ in range(5):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.sendall(b"GET /api/search?k=200 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.close()  # linger 0: a reset while the server writes
    assert api(url, "/api/meta")["rows"] == 14
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err
