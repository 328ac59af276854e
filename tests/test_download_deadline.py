"""``--timeout`` bounds one attempt as a whole, whatever the server does (loopback only).

The trickling routes of :class:`tests.downloadkit.ImageServer` send one byte
per gap: of the body, or from the status line on. Each read returns well
within ``read_timeout``, so only the attempt's deadline can end them.
"""

from __future__ import annotations

import time

import lance
import pytest
from prx_data.pipelines.download import DownloadConfig, run_download

from prx_data.core.runtime import RunOptions
from prx_data.download import fetch as F
from tests.downloadkit import ImageServer, photo, url_table

pytestmark = pytest.mark.timeout(60)

#: One attempt may take 2 s; one read 1 s. A byte every 0.5 s (or 0.9 s) never trips the read.
DEADLINE = dict(total_timeout=2.0, read_timeout=1.0, connect_timeout=1.0, retries=0, backoff=0.01)


def _timed(f: F.Fetcher, url: str) -> tuple[F.FetchResult, float]:
    t0 = time.monotonic()
    r = f.fetch(url)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("path", ["/trickle/500", "/trickle/900", "/trickle-head/500"])
def test_a_trickling_server_is_cut_at_the_deadline(path):
    with ImageServer() as srv:
        f = F.Fetcher(F.FetchConfig(allow=srv.allow, **DEADLINE))
        try:
            r, took = _timed(f, srv.url(path))
            assert (r.status, r.reason) == (F.TRANSIENT, "timeout")
            assert 1.9 <= took < 3.0, took
            assert r.data is None
            # The fetcher goes on: the next request (on a fresh or pooled connection) is whole,
            # and one made after the cut attempt's deadline is not cut for it.
            ok, _ = _timed(f, srv.url("/img/4"))
            assert (ok.status, ok.data) == (F.OK, photo(4))
            time.sleep(0.3)
            ok, _ = _timed(f, srv.url("/slow/5"))
            assert (ok.status, ok.data) == (F.OK, photo(5))
        finally:
            f.close()


def test_the_deadline_covers_dns():
    def slow_resolver(host: str, port: int) -> list[str]:
        time.sleep(5)
        return ["127.0.0.1"]

    with ImageServer() as srv:
        f = F.Fetcher(F.FetchConfig(allow=srv.allow, **DEADLINE), resolver=slow_resolver)
        try:
            r, took = _timed(f, f"http://images.example:{srv.port}/img/1")
            assert (r.status, r.reason) == (F.TRANSIENT, "timeout")
            assert took < 3.0, took
            assert not srv.hits
        finally:
            f.close()


def test_requests_within_the_deadline_are_untouched():
    """Many fast fetches on pooled connections: none cut by an earlier attempt's watchdog entry."""
    with ImageServer() as srv:
        cfg = F.FetchConfig(allow=srv.allow, **{**DEADLINE, "total_timeout": 0.5, "per_host": 2})
        f = F.Fetcher(cfg)
        try:
            for round_ in range(3):
                results = f.fetch_many([srv.url(f"/img/{i}") for i in range(12)])
                assert [r.status for r in results] == [F.OK] * 12, round_
                time.sleep(0.6)  # past every earlier deadline: their entries fire on idle sockets
        finally:
            f.close()


@pytest.mark.timeout(120)
def test_download_job_records_timeout_and_moves_on(tmp_path):
    """One trickling row: the job spends about timeout x attempts on it and fills the rest."""
    uri = str(tmp_path / "t.lance")
    with ImageServer() as srv:
        url_table(uri, [srv.url("/trickle/500"), srv.url("/img/1"), srv.url("/img/2")])
        fetch = F.FetchConfig(
            allow=srv.allow, total_timeout=3.0, read_timeout=20.0, retries=1, backoff=0.01
        )
        t0 = time.monotonic()
        report = run_download(
            DownloadConfig(
                uri,
                fetch=fetch,
                run=RunOptions(engine="local", progress=False),
            )
        )
        took = time.monotonic() - t0
    rows = {
        r["id"]: r
        for r in lance.dataset(uri)
        .to_table(columns=["id", "download_status", "download_error"])
        .to_pylist()
    }
    assert (rows["laion/00000"]["download_status"], rows["laion/00000"]["download_error"]) == (
        F.TRANSIENT,
        "timeout",
    )
    assert rows["laion/00001"]["download_status"] == rows["laion/00002"]["download_status"] == "ok"
    assert report.reasons.get("timeout") == 1
    assert took < 20, took  # 2 attempts x 3 s, plus start-up; 82 s before the deadline held
