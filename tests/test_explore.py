"""Explorer HTTP API: search, similar, thumbnails, filters, escaping, binding and hardening."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from prx_data.cli import explore as explore_cli
from prx_data.core.runtime import RunOptions
from prx_data.explore import app as explore
from tests.explore_kit import (
    XSS_CAPTION,
    big_jpeg,
    big_png,
    make_enriched_table,
    make_explore_table,
    make_scored_table,
    running_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("explore") / "t.lance")
    make_explore_table(uri)
    with running_server(uri, build_indexes=True) as (url, srv):
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
    for opt in (
        "--table",
        "--host",
        "--port",
        "--descriptors",
        "--build-indexes",
        "--allow-host",
        "127.0.0.1",
    ):
        assert opt in out
    assert "--no-index" not in out  # deprecated: still accepted, no longer offered


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
        explore.ExploreConfig(
            table=make_enriched_table(str(tmp_path / "rich.lance")), build_indexes=True
        )
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
    app = explore.Explorer(explore.ExploreConfig(table=uri, build_indexes=True))
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
        s.sendall(b"GET /api/search?k=200 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.close()  # linger 0: a reset while the server writes
    assert api(url, "/api/meta")["rows"] == 14
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err


# --- hardening: Host allow-list, bounded paging, bounded pool, bombs, timeouts, start-up ----


@pytest.fixture(scope="module")
def plain_table(tmp_path_factory):
    """The explore table plus oversized images, with no indexes; nothing here may change it."""
    uri = str(tmp_path_factory.mktemp("plain") / "t.lance")
    make_explore_table(
        uri,
        extra=[
            # 48 MP: under Pillow's own bomb limit (179 MP), over the thumbnail limit.
            ("t/bomb", big_png(8000, 6000), "a png that decodes to 48 MP"),
            # 200 MP: Pillow refuses to even open it.
            ("t/hugebomb", big_png(20000, 10000), "a png that decodes to 200 MP"),
            # 41 MP, but a JPEG: its DCT draft decodes 0.6 MP, so it is shown.
            ("t/bigjpeg", big_jpeg(6400, 6400), "a large jpeg"),
        ],
    )
    return uri


def raw_get(url: str, path: str, host: str | None) -> tuple[int, bytes]:
    """GET with exactly this Host header (None: none at all)."""
    import http.client

    netloc = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(netloc.hostname, netloc.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_foreign_host_is_refused_and_loopback_served(server):
    url, srv = server
    port = srv.server_address[1]
    for host in (
        "rebind.example",
        f"rebind.example:{port}",
        f"127.0.0.1.rebind.example:{port}",
        "localhost.rebind.example",
        f"127.0.0.1:{port}@rebind.example",
        "127.0.0.2",
        "",
    ):
        for path in ("/", "/api/search?q=green", "/api/thumb?id=t%2Fgreen0", "/static/app.js"):
            status, body = raw_get(url, path, host)
            assert status == 421, (host, path, status)
            assert b"not served here" in body and b"t/green" not in body
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        f"LOCALHOST:{port}",
        "localhost:9000",  # a forwarded port (ssh -L 9000:localhost:PORT) is fine
        "[::1]",
        f"[::1]:{port}",
    ):
        status, body = raw_get(url, "/api/search?q=green", host)
        assert status == 200, (host, body)
        assert b"t/green0" in body
    assert raw_get(url, "/api/meta", None)[0] == 400  # no Host at all


def test_allowed_host_names():
    cfg = explore.ExploreConfig(table="x", host="10.1.2.3", allowed_hosts=("Explorer.LAN",))
    assert explore.allowed_host_names(cfg) == {
        "127.0.0.1",
        "localhost",
        "[::1]",
        "10.1.2.3",
        "explorer.lan",
    }
    wildcard = explore.allowed_host_names(explore.ExploreConfig(table="x", host="0.0.0.0"))
    assert wildcard == {"127.0.0.1", "localhost", "[::1]"}
    with pytest.raises(ValueError, match="allowed host"):
        explore.ExploreConfig(table="x", allowed_hosts=("evil.example/path",))


def test_offset_and_page_size_are_bounded(server):
    url, _ = server
    status, _, body = get(f"{url}/api/search?offset={10**15}&tier=too_small")
    assert status == 400 and b"offset" in body  # O(offset) with a filter: refused up front
    for query, name in (
        ("offset=1000000000000000", "offset"),
        ("offset=1000000000000000&tier=too_small", "offset"),
        (f"offset={explore.MAX_OFFSET + 1}", "offset"),
        ("offset=-1", "offset"),
        ("offset=%D9%A5", "offset"),  # a non-ASCII digit
        (f"k={explore.MAX_PAGE + 1}", "k"),
        ("k=0", "k"),
    ):
        status, _, body = get(f"{url}/api/search?{query}")
        assert status == 400, (query, status)
        assert name in json.loads(body)["error"], body
    status, _, body = get(f"{url}/api/similar?id=t%2Fred0&k=1000000000")
    assert status == 400 and b"k" in body
    status, _, body = get(f"{url}/api/thumb?id=t%2Fred0&size=100000")
    assert status == 400 and b"size" in body
    deepest = api(url, "/api/search", offset=explore.MAX_OFFSET, k=explore.MAX_PAGE)
    assert deepest["results"] == [] and deepest["next_offset"] is None
    with pytest.raises(ValueError, match="page size"):
        explore.ExploreConfig(table="x", page_size=explore.MAX_PAGE + 1)


def test_saturated_pool_answers_503_rather_than_starting_threads(plain_table):
    import threading

    with running_server(plain_table, workers=1, queue=0) as (url, srv):
        assert api(url, "/api/meta")["rows"] == 17
        entered, release = threading.Event(), threading.Event()
        real_meta = srv.app.meta

        def slow_meta():
            entered.set()
            release.wait(30)
            return real_meta()

        srv.app.meta = slow_meta

        def hold() -> None:
            # The worker frees its slot just after the previous reply: retry until it is taken.
            for _ in range(100):
                if get(url + "/api/meta")[0] != 503 or entered.is_set():
                    return
                time.sleep(0.05)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert entered.wait(30)  # the only worker is now taken
            threads = threading.active_count()
            replies = [get(url + "/api/search") for _ in range(6)]
            assert [r[0] for r in replies] == [503] * 6
            assert replies[0][1]["Retry-After"] == "1"
            assert b"busy" in replies[0][2]
            assert threading.active_count() == threads  # no thread per request
        finally:
            release.set()
            holder.join(30)
        srv.app.meta = real_meta
        # Served again once free: the worker frees its slot just after its reply, so the first
        # request may still find it taken.
        for _ in range(100):
            status, _, body = get(url + "/api/search")
            if status != 503:
                break
            time.sleep(0.05)
        assert status == 200 and json.loads(body)["mode"] == "browse"


def test_bomb_thumbnails_are_refused_and_the_server_lives(plain_table):
    with running_server(plain_table) as (url, _):
        for row_id, why in (("t/bomb", b"8000x6000"), ("t/hugebomb", b"decompression bomb")):
            for _ in range(2):  # the refusal is cached like a thumbnail
                status, headers, body = get(f"{url}/api/thumb?id={urllib.parse.quote(row_id)}")
                assert status == 422, (row_id, status)
                assert headers["Content-Type"].startswith("application/json")
                assert why in body, body
        status, headers, body = get(f"{url}/api/thumb?id=t%2Fbigjpeg")
        assert status == 200 and headers["Content-Type"] == "image/jpeg"
        import io

        from PIL import Image

        assert max(Image.open(io.BytesIO(body)).size) == explore.THUMB_SIZE
        assert api(url, "/api/meta")["rows"] == 17


def test_thumbnail_timeout_is_an_http_error(plain_table, monkeypatch, capfd):
    import threading

    release = threading.Event()
    real = explore._thumb_bytes

    def stuck(data, size):
        release.wait(30)
        return real(data, size)

    monkeypatch.setattr(explore, "_thumb_bytes", stuck)
    with running_server(plain_table, thumb_timeout_s=0.05) as (url, srv):
        try:
            status, _, body = get(f"{url}/api/thumb?id=t%2Fred0&size=80")
            assert status == 504, status
            assert b"not ready" in body
            assert api(url, "/api/meta")["rows"] == 17  # the worker was given back
            with srv.app._lock:
                fut = srv.app._pending.get(("t/red0", 80))
        finally:
            release.set()
        if fut is not None:
            fut.result(timeout=30)
        status, headers, _ = get(f"{url}/api/thumb?id=t%2Fred0&size=80")
        assert status == 200 and headers["Content-Type"] == "image/jpeg"
    assert "Traceback" not in capfd.readouterr().err


def test_thumbnail_queue_is_bounded(plain_table, monkeypatch):
    import threading

    release = threading.Event()
    real = explore._thumb_bytes
    monkeypatch.setattr(explore, "_thumb_bytes", lambda d, n: (release.wait(30), real(d, n))[1])
    app = explore.Explorer(explore.ExploreConfig(table=plain_table, thumb_queue=3))
    try:
        app.prefetch([f"t/red{i}" for i in range(4)] + ["t/blue0"], 64)
        app.prefetch(["t/green0", "t/green1"], 64)  # best effort: skipped while full
        with app._lock:
            assert sorted(k[0] for k in app._pending) == ["t/red0", "t/red1", "t/red2"]
        with pytest.raises(explore.RequestError, match="queue is full") as e:
            app.thumbnail("t/green3", 64)
        assert e.value.status == 503
    finally:
        release.set()
        app.close()


def test_startup_leaves_the_table_unchanged_unless_asked(tmp_path, capsys):
    import lance

    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    before = lance.dataset(uri).version
    app = explore.Explorer(explore.ExploreConfig(table=uri))
    try:
        out = capsys.readouterr().out
        assert lance.dataset(uri).version == before
        would = [line for line in out.splitlines() if line.startswith("would ")]
        assert would == [
            "would compute pixel descriptors for 14 rows (until then: no similar images)",
            "would build an INVERTED index on caption (full-text search; until then the "
            "search box matches ids only)",
            "would build a BTREE index on id (fast id lookups)",
        ]
        assert "--build-indexes" in out
        # It runs with what exists: no text index, no vectors, but browse and ids work.
        meta = app.meta()
        assert meta["text_columns"] == [] and meta["vector_column"] is None
        assert [r["id"] for r in app.search({"q": "t/green1"})["results"]] == ["t/green1"]
        assert len(app.search({})["results"]) == 14
    finally:
        app.close()
    app = explore.Explorer(explore.ExploreConfig(table=uri, build_indexes=True))
    app.close()
    built = lance.dataset(uri).version
    assert built > before
    capsys.readouterr()
    app = explore.Explorer(explore.ExploreConfig(table=uri))
    try:
        assert "would" not in capsys.readouterr().out  # nothing left to build
        assert lance.dataset(uri).version == built
        assert app.meta()["text_columns"] == ["caption"]
    finally:
        app.close()


def test_check_runs_while_the_default_port_is_taken_and_a_taken_port_is_one_line(tmp_path, capsys):
    import socket

    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert explore_cli.main(["--table", uri, "--check"]) == 0  # any free port
        assert "explorer ok" in capsys.readouterr().out
        assert explore_cli.main(["--table", uri, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: port {port} on 127.0.0.1 is in use (another explorer?): pass "
        "--port 0 for any free port, or another --port"
    ]


def test_cli_build_indexes_is_opt_in_and_no_index_is_a_no_op(monkeypatch, capsys):
    made: list[explore.ExploreConfig] = []

    class Stub:
        server_address = ("127.0.0.1", 1)

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    def fake_serve(cfg):
        made.append(cfg)
        return Stub()

    monkeypatch.setattr(explore_cli, "serve", fake_serve)
    assert explore_cli.main(["--table", "t.lance"]) == 0
    assert made[-1].build_indexes is False
    assert explore_cli.main(["--table", "t.lance", "--no-index"]) == 0
    assert made[-1].build_indexes is False
    assert "deprecated" in capsys.readouterr().err
    assert explore_cli.main(["--table", "t", "--build-indexes", "--allow-host", "box.lan"]) == 0
    assert made[-1].build_indexes is True and made[-1].allowed_hosts == ("box.lan",)
    with pytest.raises(SystemExit):
        explore_cli.main(["--table", "t", "--page-size", "1000"])
    assert "page size" in capsys.readouterr().err


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("scored") / "t.lance")
    scores = make_scored_table(uri)
    with running_server(uri) as (url, _srv):
        yield url, scores


def test_filter_and_sort_by_any_numeric_column(scored):
    url, scores = scored
    meta = api(url, "/api/meta")
    assert meta["scores"] == [
        "image_quality.std",
        "image_quality.entropy",
        "image_quality.flat",
        "clip_score",
    ]
    ranked = sorted((v, k) for k, v in scores.items() if v is not None)
    res = api(url, "/api/search", sort="clip_score", order="desc", k="5")
    assert [r["id"] for r in res["results"]] == [k for _, k in ranked[::-1][:5]]
    assert res["sort"] == "clip_score" and res["order"] == "desc"
    low = api(url, "/api/search", sort="clip_score", order="asc", **{"min.clip_score": "0.3"})
    got = [r["id"] for r in low["results"]]
    assert got == [k for v, k in ranked if v >= 0.3 - 1e-6]
    page2 = api(url, "/api/search", sort="clip_score", order="asc", k="4", offset="4")
    assert [r["id"] for r in page2["results"]] == [k for _, k in ranked[4:8]]
    # Unscored rows come last either way.
    everything = api(url, "/api/search", sort="clip_score", k="200")["results"]
    assert [r["id"] for r in everything][: len(ranked)] == [k for _, k in ranked[::-1]]
    # Struct fields filter and sort like columns.
    std = api(url, "/api/search", sort="image_quality.std", order="desc", k="200")["results"]
    vals = [r["scores"]["image_quality.std"] for r in std if "image_quality.std" in r["scores"]]
    assert vals == sorted(vals, reverse=True) and len(vals) >= 12
    cut = sorted(vals)[len(vals) // 2]
    high = api(url, "/api/search", k="200", **{"min.image_quality.std": repr(cut)})["results"]
    assert all(r["scores"]["image_quality.std"] >= cut for r in high) and high
    for bad in (
        "sort=caption",
        "sort=clip_score&order=up",
        f"sort=clip_score&offset={explore.MAX_SORTED_OFFSET + 1}",
        "min.image_quality.std=x",
    ):
        status, _, body = get(f"{url}/api/search?{bad}")
        assert status == 400, (bad, body)


def test_cluster_view_shows_near_duplicates_and_the_kept_one(scored):
    url, _ = scored
    from prx_data.skips.semdedup import DEFAULT_THRESHOLD

    assert explore.CLUSTER_COSINE == DEFAULT_THRESHOLD
    meta = api(url, "/api/meta")
    assert meta["cluster_column"] == "clip_image_embedding"
    res = api(url, "/api/cluster", id="t/red0")
    # red0..red2 are within cosine 0.95 of red0; red3 and the other colours are not.
    assert [m["id"] for m in res["members"]] == ["t/red1", "t/red0", "t/red2"]  # largest first
    assert res["keeper"] == "t/red1" and res["cosine"] == DEFAULT_THRESHOLD
    assert all(m["cosine"] >= DEFAULT_THRESHOLD for m in res["members"])
    loose = api(url, "/api/cluster", id="t/red0", cosine="0.5")
    assert {m["id"] for m in loose["members"]} == {f"t/red{i}" for i in range(4)}
    assert api(url, "/api/cluster", id="t/xss")["error"] == "no vector for this image"
    for bad in ("cosine=2", "cosine=x", "k=0"):
        status, _, _ = get(f"{url}/api/cluster?id=t/red0&{bad}")
        assert status == 400


def test_structured_attributes_are_drop_down_filters(tmp_path):
    import pyarrow as pa

    from prx_data.table.lance_ops import update_column

    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    ids = [f"t/{c}{i}" for c in ("red", "green", "blue") for i in range(4)]
    st = pa.struct(
        [
            pa.field("style", pa.string()),
            pa.field("subjects", pa.list_(pa.string())),
            pa.field("text_present", pa.bool_()),
        ]
    )
    values = [
        {"style": "photo" if i.startswith("t/red") else "illustration", "subjects": ["object"],
         "text_present": i.endswith("0")}
        for i in ids
    ]  # fmt: skip
    update_column(uri, "attributes", pa.table({"id": ids, "attributes": pa.array(values, st)}))
    with running_server(uri) as (url, _srv):
        labels = api(url, "/api/meta")["labels"]
        assert labels["attributes.style"] == ["illustration", "photo"]
        assert labels["attributes.text_present"] == ["false", "true"]
        photos = api(url, "/api/search", **{"label.attributes.style": "photo"})["results"]
        assert sorted(r["id"] for r in photos) == [f"t/red{i}" for i in range(4)]
        assert photos[0]["labels"]["attributes.style"] == "photo"
        text = api(
            url,
            "/api/search",
            **{"label.attributes.text_present": "true", "label.attributes.style": "illustration"},
        )["results"]
        assert sorted(r["id"] for r in text) == ["t/blue0", "t/green0"]
        status, _, body = get(f"{url}/api/search?label.attributes.text_present=yes")
        assert status == 400 and b"true or false" in body


def test_cluster_view_shows_the_stored_semdedup_cluster(tmp_path):
    import lance
    from prx_data.pipelines.semdedup import SemDedupConfig, run_semdedup

    uri = str(tmp_path / "t.lance")
    make_scored_table(uri)
    run_semdedup(
        SemDedupConfig(
            uri,
            cluster_size=4,
            run=RunOptions(engine="local"),
        )
    )
    t = lance.dataset(uri).to_table(columns=["id", "semdedup_cluster"]).to_pydict()
    cluster = dict(zip(t["id"], t["semdedup_cluster"], strict=True))
    same = {i for i, c in cluster.items() if c is not None and c == cluster["t/red0"]}
    with running_server(uri) as (url, _srv):
        res = api(url, "/api/cluster", id="t/red0")
        assert res["stored"] is True and res["cluster"] == cluster["t/red0"]
        ids = [m["id"] for m in res["members"]]
        assert "t/red0" in ids and set(ids) <= same
        assert res["keeper"] == ids[0] and all(m["cosine"] >= 0.95 for m in res["members"])
        assert any(m["semdedup_cosine"] is None for m in res["members"])  # the cluster's best
        # At any cosine only the stored cluster's members, never a neighbour outside it.
        everyone = api(url, "/api/cluster", id="t/red0", cosine="-1")
        assert {m["id"] for m in everyone["members"]} == same
        # Rows without a stored cluster fall back to nearest neighbours.
        assert api(url, "/api/cluster", id="t/xss")["error"] == "no vector for this image"
