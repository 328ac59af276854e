"""Explorer HTTP API: search, similar, thumbnails, filters, escaping and binding."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from prx_data.cli import explore as explore_cli
from prx_data.explore import app as explore
from tests.explore_kit import XSS_CAPTION, make_explore_table, running_server


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
