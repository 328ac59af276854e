"""The download job: URL rows become image rows, safely, once, resumably (loopback only)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import lance
import pyarrow as pa
import pytest
from prx_data.pipelines.download import DownloadConfig, run_download

from prx_data.core.runtime import RunOptions
from prx_data.download import fetch as F
from tests.downloadkit import ImageServer, photo, url_table

#: Nothing here may hang: a stuck fetch fails the test instead of blocking the suite.
pytestmark = pytest.mark.timeout(180)

FAST = dict(read_timeout=0.4, connect_timeout=1.0, total_timeout=3.0, retries=1, backoff=0.01)


def cfg_for(uri: str, srv: ImageServer, **kw) -> DownloadConfig:
    fetch = F.FetchConfig(allow=srv.allow, **{**FAST, **kw.pop("fetch", {})})
    return DownloadConfig(
        uri, fetch=fetch, run=RunOptions(engine=kw.pop("engine", "local"), progress=False), **kw
    )


def rows_by_id(uri: str, columns=None) -> dict[str, dict]:
    t = lance.dataset(uri).to_table(columns=columns)
    return {r["id"]: r for r in t.to_pylist()}


# --- address policy (no connection is ever made to a refused address) ------------------


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # cloud metadata
        "fd00:ec2::254",  # AWS metadata over IPv6
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # carrier-grade NAT
        "fe80::1",
        "0.0.0.0",
        "224.0.0.1",
        "::ffff:127.0.0.1",  # IPv4-mapped loopback
        "::ffff:169.254.169.254",
    ],
)
def test_policy_refuses_non_public_addresses_by_default(address):
    assert not F.AddressPolicy().permits(address, 80)


def test_policy_allows_public_and_only_what_it_names():
    assert F.AddressPolicy().permits("93.184.216.34", 80)
    assert F.AddressPolicy().permits("2606:2800:220:1:248:1893:25c8:1946", 443)
    p = F.AddressPolicy(("127.0.0.1:8080", "10.0.0.0/8"))
    assert p.permits("127.0.0.1", 8080) and not p.permits("127.0.0.1", 8081)
    assert p.permits("10.9.9.9", 1) and not p.permits("192.168.0.1", 1)
    assert not p.permits("169.254.169.254", 80)
    with pytest.raises(ValueError, match="not an IP"):
        F.AddressPolicy(("localhost",))


def test_fetcher_refuses_hosts_that_resolve_to_private_addresses_without_connecting():
    names = {
        "metadata.test": ["169.254.169.254"],
        "intranet.test": ["10.0.0.5"],
        "mixed.test": ["10.0.0.5", "93.184.216.34"],
    }
    f = F.Fetcher(F.FetchConfig(retries=0), resolver=lambda host, port: names[host])
    for url in ("http://metadata.test/latest/meta-data/", "http://intranet.test/a.jpg"):
        r = f.fetch(url)
        assert (r.status, r.reason) == (F.REFUSED, "refused_address"), url
    assert f.fetch("http://169.254.169.254/").reason == "refused_address"
    assert f.fetch("file:///etc/passwd").reason == "bad_scheme"
    assert f.fetch("http://user:pw@93.184.216.34/").reason == "credentials_in_url"
    assert not f._pools  # nothing was connected to
    # A name with a public and a private address connects to the vetted public one.
    assert f._vet("http://mixed.test/a.jpg")[-1] == "93.184.216.34"


def test_https_to_the_vetted_address_still_verifies_the_name(tmp_path):
    """The connection goes to the checked IP; TLS still checks the certificate's host name."""
    from tests.downloadkit import self_signed

    cert, key = self_signed(tmp_path, "images.test")
    names = {"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}
    with ImageServer() as srv:
        srv.use_tls(cert, key)
        kw = dict(allow=srv.allow, retries=0, ca_bundle=cert)
        f = F.Fetcher(F.FetchConfig(**kw), resolver=lambda h, p: names[h])
        ok = f.fetch(f"https://images.test:{srv.port}/img/4")
        assert (ok.status, ok.data) == (F.OK, photo(4))
        wrong = f.fetch(f"https://other.test:{srv.port}/img/4")
        assert (wrong.status, wrong.reason) == (F.PERMANENT, "tls_error")
        untrusted = F.Fetcher(
            F.FetchConfig(allow=srv.allow, retries=0), resolver=lambda h, p: names[h]
        )
        assert untrusted.fetch(f"https://images.test:{srv.port}/img/4").reason == "tls_error"


def test_urls_with_spaces_unicode_and_international_names():
    names = {"xn--bcher-kva.test": ["127.0.0.1"]}
    with ImageServer() as srv:
        f = F.Fetcher(F.FetchConfig(allow=srv.allow, **FAST), resolver=lambda h, p: names[h])
        r = f.fetch(srv.url("/img/7?q=a b&c=é"))
        assert (r.status, r.data) == (F.OK, photo(7))
        assert "/img/7?q=a%20b&c=%C3%A9" in srv.hits
        idn = f.fetch(f"http://bücher.test:{srv.port}/img/8")
        assert (idn.status, idn.data) == (F.OK, photo(8))
        f.close()


def test_x_robots_tag_parsing():
    ua = "prx-data-download/1"
    assert F.robots_opt_out(["noai"], F.DEFAULT_OPT_OUT, ua) == "noai"
    assert F.robots_opt_out(["noindex, NoImageAI"], F.DEFAULT_OPT_OUT, ua) == "noimageai"
    assert F.robots_opt_out(["googlebot: noai"], F.DEFAULT_OPT_OUT, ua) is None
    assert F.robots_opt_out(["prx-data-download: noai"], F.DEFAULT_OPT_OUT, ua) == "noai"
    assert F.robots_opt_out(["noai"], (), ua) is None


# --- one URL against a hostile loopback server ---------------------------------------------

CASES = {
    "/img/1": (F.OK, None),
    "/png/2": (F.OK, None),
    "/octet/3": (F.OK, None),
    "/slow/4": (F.OK, None),
    "/chain/3": (F.OK, None),
    "/otherbot/5": (F.OK, None),
    "/429once/6": (F.OK, None),
    "/503once/7": (F.OK, None),
    "/stall/8": (F.TRANSIENT, "timeout"),
    "/status/500": (F.TRANSIENT, "http_500"),
    "/status/404": (F.PERMANENT, "http_404"),
    "/status/403": (F.PERMANENT, "http_403"),
    "/loop/x": (F.PERMANENT, "redirect_loop"),
    "/chain/9": (F.PERMANENT, "too_many_redirects"),
    "/redirect-away/x": (F.REFUSED, "refused_address"),
    "/redirect-metadata/x": (F.REFUSED, "refused_address"),
    "/html/x": (F.PERMANENT, "wrong_content_type"),
    "/fake/x": (F.PERMANENT, "not_an_image"),
    "/big/1": (F.PERMANENT, "too_large"),
    "/bigstream/1": (F.PERMANENT, "too_large"),
    "/bomb/x": (F.PERMANENT, "decompression_bomb"),
    "/noai/1": (F.OPTED_OUT, "x_robots_tag:noai"),
}


def test_fetcher_outcomes_against_a_hostile_server():
    with ImageServer(stall_s=2) as other, ImageServer(stall_s=2, redirect_port=other.port) as srv:
        f = F.Fetcher(F.FetchConfig(allow=srv.allow, max_bytes=200_000, **FAST))
        paths = list(CASES)
        results = f.fetch_many([srv.url(p) for p in paths])
        f.close()
        got = {p: (r.status, r.reason) for p, r in zip(paths, results, strict=True)}
        assert got == CASES
        by_path = dict(zip(paths, results, strict=True))
        assert by_path["/img/1"].data == photo(1)
        assert by_path["/chain/3"].data == photo(3)
        assert (by_path["/png/2"].format, by_path["/png/2"].width) == ("png", 96)
        # Retries: transient ones again (429 after its Retry-After), permanent ones never.
        assert srv.hits["/429once/6"] == 2 and srv.hits["/503once/7"] == 2
        t = srv.times["/429once/6"]
        assert t[1] - t[0] >= 0.95
        assert srv.hits["/status/500"] == 2 and srv.hits["/stall/8"] == 2
        assert srv.hits["/status/404"] == 1 and srv.hits["/bomb/x"] == 1
        # The refused hop was never requested, and the cap held while streaming.
        assert sum(other.hits.values()) == 0
        assert by_path["/bigstream/1"].received <= 200_000 + 65536


def test_per_host_concurrency_and_rate_limits_hold():
    with ImageServer() as srv:
        f = F.Fetcher(F.FetchConfig(allow=srv.allow, threads=8, per_host=2, **FAST))
        results = f.fetch_many([srv.url(f"/slow/{i}") for i in range(8)])
        assert all(r.status == F.OK for r in results)
        assert srv.max_inflight == 2
        f.close()
        paced = F.Fetcher(F.FetchConfig(allow=srv.allow, threads=8, per_host_rate=20, **FAST))
        assert all(
            r.status == F.OK for r in paced.fetch_many([srv.url(f"/img/{i}") for i in range(6)])
        )
        starts = sorted(t[0] for p, t in srv.times.items() if p.startswith("/img/"))
        assert starts[-1] - starts[0] >= 0.2  # 6 starts at 20/s: 0.25 s apart (unpaced: ms)
        paced.close()


# --- the job -------------------------------------------------------------------------------


def test_download_fills_rows_like_ingest_once_per_url(tmp_path):
    uri = str(tmp_path / "t.lance")
    with ImageServer(stall_s=2) as srv:
        paths = ["/img/1", "/png/2", "/status/404", "/img/1", "/noai/3", None, "/bomb/x", "/img/1"]
        paths += [f"/img/{i}" for i in range(10, 20)] + ["/status/404"]
        url_table(uri, [srv.url(p) if p else None for p in paths], rows_per_file=6)
        report = run_download(cfg_for(uri, srv, commit_rows=5))
        hits = dict(srv.hits)
    rows = rows_by_id(uri)
    assert len(rows) == len(paths)
    failures = {
        "/status/404": (F.PERMANENT, "http_404"),
        "/noai/3": (F.OPTED_OUT, "x_robots_tag:noai"),
        "/bomb/x": (F.PERMANENT, "decompression_bomb"),
    }
    for i, p in enumerate(paths):
        r = rows[f"laion/{i:05d}"]
        assert r["caption"] == f"caption {i}" and r["source"] == "laion"
        if p is None:
            assert r["download_status"] is None and r["image"] is None
        elif p.startswith(("/img/", "/png/")):
            seed = int(p.rsplit("/", 1)[1])
            want = photo(seed, fmt="PNG" if p.startswith("/png/") else "JPEG")
            assert r["image"] == want, p
            assert r["sha256"] == hashlib.sha256(want).hexdigest()  # duplicates' too
            assert (r["width"], r["height"], r["probe_error"]) == (96, 64, None)
            assert r["format"] == ("png" if p.startswith("/png/") else "jpeg")
            assert (r["download_status"], r["download_error"]) == ("ok", None)
        else:
            assert r["image"] is None and r["probe_error"] == "missing_image"
            assert r["sha256"] is None
            assert (r["download_status"], r["download_error"]) == failures[p]
    # Each URL fetched once, though /img/1 is in three rows and the 404 in two.
    assert hits["/img/1"] == 1 and hits["/status/404"] == 1
    assert report.duplicates_marked == 3 and report.duplicates_filled == 3
    assert report.fetched == len(set(p for p in paths if p))
    assert report.statuses == {"ok": 14, "permanent": 3, "opted_out": 1}
    assert report.reasons["http_404"] == 2 and report.reasons["x_robots_tag:noai"] == 1
    assert report.failing_hosts == {"127.0.0.1": 3}
    assert report.fetched_ok == 12 and 0 < report.success_rate < 1
    d = report.to_dict()
    assert d["failures"] == {"permanent": 3, "opted_out": 1} and "images/s" in report.text()
    # Nothing pending: a rerun fetches nothing.
    with ImageServer() as srv2:
        again = run_download(cfg_for(uri, srv2))
        assert again.pending == 0 and not srv2.hits


def test_download_does_not_rewrite_images_the_table_holds(tmp_path):
    """Rows with images share fragments with URL rows: their data files stay as they are."""
    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        n = 40
        urls = [None if i % 2 == 0 else srv.url(f"/img/{i}") for i in range(n)]
        big = [photo(1000 + i, size=(320, 240)) if i % 2 == 0 else None for i in range(n)]
        url_table(uri, urls, rows_per_file=20)
        # Put the "ingested" images in: a one-time setup write (not the job under test).
        ds = lance.dataset(uri)
        t = ds.to_table().set_column(1, "image", pa.array(big, pa.large_binary()))
        probe = [None if b else "missing_image" for b in big]
        t = t.set_column(t.schema.get_field_index("probe_error"), "probe_error", pa.array(probe))
        ds = lance.write_dataset(t, uri, mode="overwrite", max_rows_per_file=20)
        held = {f.fragment_id: [d.path for d in f.data_files()] for f in ds.get_fragments()}
        held_bytes = sum(len(b) for b in big if b)
        report = run_download(cfg_for(uri, srv))
    after = lance.dataset(uri)
    # The old fragments keep their data files (only a deletion vector was added).
    for frag in after.get_fragments():
        if frag.fragment_id in held:
            assert [d.path for d in frag.data_files()] == held[frag.fragment_id]
    rows = rows_by_id(uri, ["id", "image", "probe_error", "download_status"])
    assert all(rows[f"laion/{i:05d}"]["image"] == big[i] for i in range(0, n, 2))
    assert all(rows[f"laion/{i:05d}"]["download_status"] is None for i in range(0, n, 2))
    assert all(rows[f"laion/{i:05d}"]["image"] == photo(i) for i in range(1, n, 2))
    # Written: the fetched images plus the other columns of their rows, not the held ones.
    assert report.image_bytes <= report.bytes_written < report.image_bytes + 20_000
    assert report.bytes_written < held_bytes / 2


def test_fetch_tasks_write_the_rows_and_the_driver_gets_no_image_bytes(tmp_path, monkeypatch):
    """The driver commits what the tasks staged, fetched or copied from a duplicate's
    source: addresses and fragment metadata only."""
    from prx_data.pipelines import download as D

    seen: list[tuple[list[str], int]] = []
    add = D.Mover.add

    def spy(self, rows):
        seen.append((rows.column_names, rows.nbytes))
        return add(self, rows)

    monkeypatch.setattr(D.Mover, "add", spy)
    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        url_table(uri, [srv.url(f"/img/{i % 16}") for i in range(24)], rows_per_file=8)
        report = run_download(cfg_for(uri, srv, batch_size=8, commit_rows=8))
    assert report.statuses == {"ok": 24} and report.commits >= 2
    assert report.duplicates_marked == 8 and report.duplicates_filled == 8
    assert seen and all("image" not in cols for cols, _ in seen)
    assert sum(n for _, n in seen) < report.image_bytes / 10
    rows = rows_by_id(uri, ["id", "image", "download_status"])
    assert all(rows[f"laion/{i:05d}"]["image"] == photo(i % 16) for i in range(24))
    assert lance.dataset(uri).count_rows() == 24  # each row moved once, none twice


def test_pending_rows_are_found_without_reading_images():
    from prx_data.pipelines.download import pending_filter

    for only in ((), ("failed",), ("http_5*",)):
        assert "image" not in pending_filter("url", only).replace("missing_image", "")


def test_only_failed_and_only_reason_retry_just_those_rows(tmp_path):
    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        paths = ["/img/1", "/status/503", "/status/404", "/img/2", "/status/500"]
        url_table(uri, [srv.url(p) for p in paths])
        first = run_download(cfg_for(uri, srv, fetch={"retries": 0}))
        assert first.statuses == {"ok": 2, "transient": 2, "permanent": 1}
        before = dict(srv.hits)
        only_503 = run_download(cfg_for(uri, srv, only=("http_5*",), fetch={"retries": 0}))
        assert only_503.pending == 2
        assert srv.hits["/status/503"] == 2 and srv.hits["/status/500"] == 2
        assert srv.hits["/status/404"] == 1 and srv.hits["/img/1"] == before["/img/1"]
        failed = run_download(cfg_for(uri, srv, only=("failed",), fetch={"retries": 0}))
        assert failed.pending == 3 and srv.hits["/status/404"] == 2
        assert srv.hits["/img/1"] == 1 and srv.hits["/img/2"] == 1


@pytest.mark.faults
def test_killed_download_resumes_to_the_same_table_without_refetching(tmp_path):
    """A kill -9 after the first commit; the resume equals an uninterrupted run."""
    paths = [f"/img/{i}" for i in range(24)] + ["/status/404", "/img/3", "/noai/1"]
    cols = ["id", "image", "width", "height", "format", "probe_error", "download_status"]
    cols += ["download_error", "caption"]
    with ImageServer() as srv:
        whole, killed = str(tmp_path / "whole.lance"), str(tmp_path / "killed.lance")
        for uri in (whole, killed):
            url_table(uri, [srv.url(p) for p in paths], rows_per_file=10)
        run_download(cfg_for(whole, srv, commit_rows=4))
        srv.hits.clear()
        script = textwrap.dedent(
            f"""
            import os
            from prx_data.download import fetch as F
            from prx_data.core.runtime import RunOptions
            from prx_data.pipelines.download import DownloadConfig, run_download
            def kill(n):
                if n == 2:
                    os.kill(os.getpid(), 9)
            run_download(DownloadConfig({killed!r}, run=RunOptions(engine="local", progress=False),
                commit_rows=4, batch_size=4, on_commit=kill,
                fetch=F.FetchConfig(allow={srv.allow!r}, threads=2)))
            """
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
        assert proc.returncode == -9
        done = {
            r["id"]
            for r in lance.dataset(killed)
            .to_table(columns=["id"], filter="download_status IS NOT NULL")
            .to_pylist()
        }
        assert 0 < len(done) < len(paths)
        # The killed run's tag still pins the version it read; the resume removes it.
        from prx_data.table.pins import column_pin

        assert column_pin("download_status") in lance.dataset(killed).tags.list()
        first_hits = dict(srv.hits)
        run_download(cfg_for(killed, srv, commit_rows=4))
        assert not lance.dataset(killed).tags.list()
        # Rows the killed run committed were not fetched again.
        url_of = {f"laion/{i:05d}": p for i, p in enumerate(paths)}
        for row_id in done:
            assert srv.hits[url_of[row_id]] == first_hits[url_of[row_id]]
    a, b = rows_by_id(whole, cols), rows_by_id(killed, cols)
    assert a == b


def test_download_on_ray_and_cli(tmp_path, ray_local, capsys):
    from prx_data.cli.download import main

    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        urls = [srv.url(f"/img/{i % 5 if i < 6 else i}") for i in range(12)]  # row 5: row 0's
        url_table(uri, urls + [srv.url("/status/404")])
        report = run_download(cfg_for(uri, srv, engine="ray", limit=6))
        assert report.statuses == {"ok": 6}
        assert report.duplicates_marked == 1 and report.duplicates_filled == 1
        rc = main(
            ["--table", uri, "--allow-private", srv.allow[0], "--no-progress", "--engine", "local"]
        )
        out = capsys.readouterr().out
        assert rc == 0 and "ok 6, permanent 1" in out and "1 x http_404" in out
        assert max(srv.hits.values()) == 1
    assert main(["--table", str(tmp_path / "none.lance")]) == 2
    assert "ingest the URL list first" in capsys.readouterr().err
    assert main(["--table", uri, "--url-column", "nope"]) == 2
    assert "'nope' is not in the table" in capsys.readouterr().err
    assert main(["--table", uri, "--allow-private", "localhost"]) == 2
    bare = str(tmp_path / "bare.lance")
    lance.write_dataset(pa.table({"id": ["a"], "url": ["http://127.0.0.1:9/x"]}), bare)
    assert main(["--table", bare, "--engine", "local"]) == 2
    assert "prx_data.ingest" in capsys.readouterr().err


def test_explorer_filters_rows_by_download_status_and_error(tmp_path):
    from prx_data.explore.app import ExploreConfig, Explorer

    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        url_table(uri, [srv.url(p) for p in ("/img/1", "/status/404", "/img/2", "/noai/3")])
        run_download(cfg_for(uri, srv))
    app = Explorer(ExploreConfig(uri, descriptors="no", build_indexes=False))
    labels = app.meta()["labels"]
    assert labels["download_status"] == ["ok", "opted_out", "permanent"]
    assert "http_404" in labels["download_error"]
    hits = app.search({"label.download_status": "permanent"})
    assert [r["id"] for r in hits["results"]] == ["laion/00001"]


def test_download_fetches_url_rows_whatever_their_source_called_the_column(tmp_path):
    """A table fed by a CSV (``url``) and an older LAION ingest (``URL``): both are fetched."""
    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        urls = [srv.url(f"/img/{i}") if i < 3 else None for i in range(6)]
        upper = pa.array([None] * 3 + [srv.url(f"/img/{i}") for i in range(3, 6)], pa.string())
        url_table(uri, urls, extra={"URL": upper})
        report = run_download(cfg_for(uri, srv))
    rows = rows_by_id(uri, ["id", "image", "download_status"])
    assert all(r["download_status"] == "ok" and r["image"] for r in rows.values())
    assert report.statuses == {"ok": 6} and report.url_column == "url, URL"
