"""Download checks img2dataset users rely on: content hashes, exit status, retrying refusals,
and the download's reason carried into the export's dropped.parquet (loopback only)."""

from __future__ import annotations

import hashlib

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prx_data.pipelines.download import DownloadConfig, run_download

from prx_data.core.runtime import RunOptions
from prx_data.download import fetch as F
from tests.downloadkit import ImageServer, photo, url_table

pytestmark = pytest.mark.timeout(180)

FAST = dict(read_timeout=0.4, connect_timeout=1.0, total_timeout=3.0, retries=0, backoff=0.01)


def cfg_for(uri: str, allow: tuple[str, ...], **kw) -> DownloadConfig:
    fetch = F.FetchConfig(allow=allow, **FAST)
    return DownloadConfig(uri, fetch=fetch, run=RunOptions(engine="local", progress=False), **kw)


def test_check_hash_by_digest_length():
    data = photo(1)
    ok = F.FetchResult("u", F.OK, data=data, width=96, height=64, format="jpeg")
    assert F.check_hash(ok, hashlib.sha256(data).hexdigest().upper()).status == F.OK
    assert F.check_hash(ok, hashlib.md5(data).hexdigest()).status == F.OK
    assert F.check_hash(ok, None).status == F.OK and F.check_hash(ok, " ").data == data
    bad = F.check_hash(F.FetchResult("u", F.OK, data=data), hashlib.sha256(b"x").hexdigest())
    assert (bad.status, bad.reason, bad.data) == (F.PERMANENT, F.HASH_MISMATCH, None)
    odd = F.check_hash(F.FetchResult("u", F.OK, data=data), "not-a-digest")
    assert (odd.status, odd.reason, odd.data) == (F.PERMANENT, F.BAD_EXPECTED_HASH, None)


def test_a_sha256_column_keeps_matching_bytes_only(tmp_path):
    uri = str(tmp_path / "t.lance")
    good = hashlib.sha256(photo(1)).hexdigest()
    wrong = hashlib.sha256(photo(99)).hexdigest()
    with ImageServer() as srv:
        urls = [srv.url(p) for p in ("/img/1", "/img/2", "/img/3", "/img/1")]
        sha = pa.array([good, wrong, None, wrong], pa.string())
        url_table(uri, urls, extra={"src_sha256": sha})  # a list's sha256, as ingest names it
        report = run_download(cfg_for(uri, srv.allow))
        assert report.hash_column == "src_sha256"
        assert "hashes checked against src_sha256" in report.text()
    rows = {r["id"]: r for r in lance.dataset(uri).to_table().to_pylist()}
    assert rows["laion/00000"]["image"] == photo(1)
    assert rows["laion/00002"]["image"] == photo(3)  # no hash: nothing to check
    for rid in ("laion/00001", "laion/00003"):  # the duplicate of /img/1 has the wrong hash
        r = rows[rid]
        assert r["image"] is None and r["probe_error"] == "missing_image"
        assert (r["download_status"], r["download_error"]) == ("permanent", "hash_mismatch")
    assert report.reasons["hash_mismatch"] == 2
    # Without the check the bytes are stored.
    plain = str(tmp_path / "plain.lance")
    with ImageServer() as srv:
        url_table(plain, [srv.url("/img/2")], extra={"src_sha256": pa.array([wrong])})
        assert run_download(cfg_for(plain, srv.allow, check_hashes=False)).ok == 1


def test_all_refused_run_fails_naming_allow_private_and_only_failed_retries_it(tmp_path, capsys):
    from prx_data.cli.download import main

    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        url_table(uri, [srv.url(f"/img/{i}") for i in range(4)] + ["ftp://x/1.jpg"])
        assert main(["--table", uri, "--engine", "local", "--no-progress"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--allow-private" in err[0] and "5 of 5 rows failed" in err[0]
        assert not srv.hits  # nothing was fetched from the refused address
        base = ["--table", uri, "--engine", "local", "--no-progress"]
        base += ["--allow-private", srv.allow[0]]
        # A plain rerun leaves refused rows alone; --only failed retries them.
        assert main(base) == 0 and not srv.hits
        capsys.readouterr()
        assert main([*base, "--only", "failed", "--max-error-rate", "0.1"]) == 1
        out, err = capsys.readouterr()
        assert "ok 4, refused 1" in out and "1 of 5 rows failed" in err
        assert sum(srv.hits.values()) == 4
    refused = lance.dataset(uri).to_table(filter="download_status = 'refused'")
    assert refused["download_error"].to_pylist() == ["bad_scheme"]


def test_export_lists_the_download_reason_in_dropped_parquet(tmp_path):
    import prx_data.pipelines.write_mds as pipeline

    from prx_data.export.spec import ExportConfig

    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        urls = [srv.url("/img/1"), srv.url("/status/404"), "gopher://x/1", srv.url("/img/2")]
        url_table(uri, urls + [None])
        run_download(cfg_for(uri, srv.allow))
    out = str(tmp_path / "out")
    report = pipeline.run_export(ExportConfig(uri, out, tiers=(64,)), RunOptions(progress=False))
    dropped = {r["id"]: r for r in pq.read_table(f"{out}/dropped.parquet").to_pylist()}
    assert dropped["laion/00001"]["reason"] == "download:http_404"
    assert dropped["laion/00002"]["reason"] == "download:bad_scheme"
    assert "refused" in dropped["laion/00002"]["detail"]
    assert dropped["laion/00004"]["reason"] == "missing_image"  # never downloaded
    assert report.samples_written == 2
    # The download's failures were judged by the download; the export counts one missing row.
    assert report.failed == 1 and report.dropped["download:http_404"] == 1


def test_duplicate_planning_spilled_by_url_hash_equals_the_in_memory_plan(tmp_path, monkeypatch):
    import numpy as np
    import prx_data.pipelines.download as D

    uri = str(tmp_path / "t.lance")
    n = 3000
    rng = np.random.default_rng(5)
    urls = [f"http://h{i % 7}.example/{int(x)}" for i, x in enumerate(rng.integers(0, 1200, n))]
    status = ["ok" if i % 5 == 0 else None for i in range(n)]
    url_table(
        uri,
        urls,
        rows_per_file=700,
        extra={"download_status": pa.array(status, pa.string())},
    )
    ds = lance.dataset(uri)
    where = D.pending_filter("url")
    whole = D.plan_duplicates(ds, "url", where)
    # What the plan means, from first principles.
    addr = ds.to_table(columns=["url", "download_status"], with_row_address=True).to_pylist()
    ok = {r["url"] for r in addr if r["download_status"] == "ok"}
    seen, want = set(), []
    for r in sorted(addr, key=lambda r: r["_rowaddr"]):
        if r["download_status"] is None:
            if r["url"] in ok or r["url"] in seen:
                want.append(r["_rowaddr"])
            seen.add(r["url"])
    assert whole.tolist() == sorted(want) and len(want) > 200
    solved = []  # rows per partition solved
    real = D._by_url_hash

    def spy(ds, url, scans, rows, solve):
        return real(ds, url, scans, rows, lambda t: solved.append(t.num_rows) or solve(t))

    monkeypatch.setattr(D, "_by_url_hash", spy)
    split = D.plan_duplicates(ds, "url", where, partition_rows=200)
    assert len(solved) == 15 and max(solved) < 400 and split.tolist() == whole.tolist()
    limited = D.plan_duplicates(ds, "url", where, limit=900, partition_rows=200)
    assert limited.tolist() == D.plan_duplicates(ds, "url", where, limit=900).tolist()


def test_duplicate_sources_pair_each_duplicate_with_an_ok_row_first_spilled_or_not(tmp_path):
    """Each ``duplicate`` row takes an ok row of its URL if there is one, else the first
    final row; URLs without a final row stay unpaired; spilling changes nothing."""
    import numpy as np
    import prx_data.pipelines.download as D

    uri = str(tmp_path / "t.lance")
    n = 2000
    rng = np.random.default_rng(7)
    urls = [f"http://h.example/{int(x)}" for x in rng.integers(0, 500, n)]
    status = rng.choice(["ok", "permanent", "transient", "duplicate", None], n).tolist()
    url_table(
        uri, urls, rows_per_file=300, extra={"download_status": pa.array(status, pa.string())}
    )
    ds = lance.dataset(uri)
    rows, sources = D.duplicate_sources(ds, "url")
    table = ds.to_table(columns=["url", "download_status"], with_row_address=True).to_pylist()
    best: dict = {}
    for r in sorted(table, key=lambda r: r["_rowaddr"]):
        st = r["download_status"]
        if st not in (None, "duplicate"):
            rank = 0 if st == "ok" else 1
            if r["url"] not in best or rank < best[r["url"]][0]:
                best[r["url"]] = (rank, r["_rowaddr"])
    want = sorted(
        (r["_rowaddr"], best[r["url"]][1])
        for r in table
        if r["download_status"] == "duplicate" and r["url"] in best
    )
    assert list(zip(rows.tolist(), sources.tolist(), strict=True)) == want and len(want) > 100
    spilled = D.duplicate_sources(ds, "url", partition_rows=150)
    assert spilled[0].tolist() == rows.tolist() and spilled[1].tolist() == sources.tolist()


def test_duplicate_lookup_by_binary_search_agrees_with_set_membership():
    import numpy as np
    from prx_data.pipelines.download import _among

    rng = np.random.default_rng(3)
    for _ in range(200):
        dups = np.unique(rng.integers(0, 500, rng.integers(0, 60))).astype(np.uint64)
        addrs = rng.integers(0, 500, 40).astype(np.uint64)
        assert _among(addrs, dups).tolist() == np.isin(addrs, dups).tolist()
