"""BucketedDataset and skip lists against an S3-compatible server on loopback (moto).

Reads go through a small fault-injecting proxy in front of moto: the first
GET of every shard fails with 503, and GETs of sidecars are counted.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from prx_data.core import storage
from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec, fetch_catalog
from tests.exportkit import make_export, run_rank, skip_samples, upload_tree
from tests.s3proxy import relay, send_error

pytestmark = pytest.mark.remote
logging.getLogger("streaming").setLevel(logging.ERROR)
B1, B2 = "512/1.000", "512/0.500"


class FlakyProxy(ThreadingHTTPServer):
    """Forwards to moto; fails the first GET of each ``.mds`` object; counts GETs by suffix."""

    daemon_threads = True

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.failed: set[str] = set()
        self.gets: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def _forward(self):
        srv: FlakyProxy = self.server  # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        if self.command == "GET":
            with srv.lock:
                srv.gets[os.path.splitext(path)[1]] += 1
                flaky = path.endswith(".mds") and path not in srv.failed
                if flaky:
                    srv.failed.add(path)
            if flaky:
                send_error(self, 503, "ServiceUnavailable")
                return
        n = int(self.headers.get("Content-Length") or 0)
        relay(self, srv.upstream, self.rfile.read(n) if n else None)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture(scope="module")
def s3(moto_server, tmp_path_factory):
    """An export uploaded to a fresh bucket on the session's moto server, plus the flaky proxy."""
    import uuid

    import boto3

    bucket = f"prx-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=bucket)
    local = str(tmp_path_factory.mktemp("remote") / "ex")
    ex = make_export(local, {B1: 40, B2: 24}, samples_per_part=16, samples_per_shard=6)
    upload_tree(local, f"s3://{bucket}/ex")
    port = int(moto_server.rsplit(":", 1)[1])
    proxy = FlakyProxy(port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield {
            "export": ex,
            "bucket": bucket,
            "root": f"s3://{bucket}/ex",
            "direct": moto_server,
            "proxy": proxy,
            "proxy_url": f"http://127.0.0.1:{proxy.server_address[1]}",
        }
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_remote_skip_lists_stream_exactly_once(s3, tmp_path, monkeypatch):
    ex, root = s3["export"], s3["root"]
    # Library API against object storage: add by ids, list, stats.
    skipped = {f"ds/{B1}/{i}" for i in (1, 2, 17, 33)} | {f"ds/{B2}/5"}
    r = skip_samples(root, "optout", ids=sorted(skipped))
    assert r.samples_listed == 5 and r.ids_not_found == 0
    assert set(S.list_skip_lists(root)["optout"]) == {B1, B2}
    n_sidecars = sum(S.list_skip_lists(root)["optout"].values())
    stats = {b.bucket: b for b in S.skip_stats(root)["optout"]}
    assert stats[B1].skipped == 4

    # Stream through the flaky proxy: every shard's first GET fails and is retried.
    monkeypatch.setenv("S3_ENDPOINT_URL", s3["proxy_url"])
    proxy: FlakyProxy = s3["proxy"]
    proxy.gets.clear()
    cache = str(tmp_path / "cache")
    spec = DatasetSpec(root, local=cache)
    kw = dict(tier=512, num_canonical_nodes=2, small_buckets="drop", download_retry=3)
    runs = [run_rank(spec, rank=r, world_size=2, batch_size=4, **kw) for r in range(2)]
    seen = [i for run in runs for b in run.batches for i in b]
    assert len(seen) == len(set(seen)) and not set(seen) & skipped
    kept = collections.Counter(ex.where[i][0] for i in ex.where if i not in skipped)
    assert len(seen) == sum((n // 8) * 8 for n in kept.values())
    assert all(len(s) == 1 for run in runs for s in run.shapes)
    assert proxy.failed, "no transient failure was injected"
    # Each simulated rank is its own node's leader over one cache: the second found every
    # sidecar unchanged there (stream/fetched.py), so each was fetched once.
    assert proxy.gets[".skip"] == n_sidecars

    # Another rank of the same node reuses the leader's cache and makes no request.
    proxy.gets.clear()
    buckets = fetch_catalog(spec, [512], cache, is_leader=False, timeout=5)
    assert buckets == [B2, B1] and sum(proxy.gets.values()) == 0


def test_remote_proportions_and_mismatched_sidecar(s3, tmp_path, monkeypatch):
    root = s3["root"]
    monkeypatch.setenv("S3_ENDPOINT_URL", s3["direct"])
    other = make_export(str(tmp_path / "o"), {B1: 16}, name="other")
    upload_tree(other.root, f"s3://{s3['bucket']}/other")
    specs = [
        DatasetSpec(root, local=str(tmp_path / "c1"), proportion=0.5, skip_lists=[]),
        DatasetSpec(f"s3://{s3['bucket']}/other", local=str(tmp_path / "c2"), proportion=0.5),
    ]
    run = run_rank(
        specs, rank=0, world_size=1, batch_size=4, tier=512, epoch_size=64, small_buckets="drop"
    )
    seen = [i for b in run.batches for i in b]
    share = sum(i.startswith("other/") for i in seen) / len(seen)
    assert abs(share - 0.5) <= 2 * 4 / len(seen)  # one batch per bucket of rounding

    # Rewriting a remote export without its skipped samples, verified sample by sample.
    from prx_data.skips.rewrite import rewrite_export

    r = rewrite_export(root, str(tmp_path / "clean"), force=True)
    assert r.verified and r.samples_out == r.samples_in - r.skipped
    assert len(set(S.read_manifests(str(tmp_path / "clean"))["id"].to_pylist())) == r.samples_out

    # A sidecar for a shard that was rewritten is refused, naming the remote file.
    shards = S.read_index(root, B2)
    info = shards[0]
    bad = S.SkipList(
        "stale",
        S.ShardInfo(info.basename, info.bytes, info.samples + 1, {}),
        np.array([0], np.uint32),
    )
    storage.write_bytes_atomic(f"{root}/{B2}/{info.basename}.stale.skip", bad.to_bytes())
    with pytest.raises(
        S.SkipListError, match=r"stale\.skip: sidecar does not match its shard.*samples"
    ):
        run_rank(
            DatasetSpec(root, local=str(tmp_path / "c3")),
            rank=0,
            world_size=1,
            batch_size=4,
            tier=512,
            small_buckets="drop",
        )
    assert skip_samples(root, "stale", remove=True).removed == 1
