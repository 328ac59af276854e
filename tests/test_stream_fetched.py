"""A node leader's catalog fetch downloads only what changed since the last start.

Remote roots live on the session's moto server; every request goes through a
recording proxy (tests/s3proxy.py), so the GETs of catalog files are counted
on the wire. Listings (GETs of the bucket itself) are not catalog downloads.
"""

from __future__ import annotations

import json
import os

import pytest

from prx_data.core import storage
from prx_data.skips import sidecar as S
from prx_data.stream import fetched
from prx_data.stream.dataset import DatasetSpec, fetch_catalog
from tests.exportkit import make_export, skip_samples, upload_tree
from tests.s3proxy import RuleProxy

pytestmark = pytest.mark.remote
B1, B2 = "512/1.000", "512/0.500"
CATALOG = (".skip", "index.json", "report.json")


@pytest.fixture
def proxy(moto_server, monkeypatch):
    with RuleProxy(int(moto_server.rsplit(":", 1)[1])) as p:
        monkeypatch.setenv("S3_ENDPOINT_URL", p.url)
        yield p


def _gets(proxy: RuleProxy) -> int:
    """Catalog files downloaded since the last call."""
    with proxy.lock:
        n = sum(1 for m, p, _ in proxy.log if m == "GET" and p.endswith(CATALOG))
        proxy.log.clear()
    return n


def _fetch(root: str, cache: str) -> list[str]:
    return fetch_catalog(DatasetSpec(root, local=cache), [512], cache, is_leader=True)


def _skips(cache: str, bucket: str) -> set[str]:
    d = os.path.join(cache, *bucket.split("/"))
    return {
        os.path.relpath(os.path.join(p, f), d)
        for p, _, files in os.walk(d)
        for f in files
        if f.endswith(".skip")
    }


def test_second_start_fetches_nothing_unchanged_and_each_change_once(s3_bucket, proxy, tmp_path):
    root = f"s3://{s3_bucket}/ex"
    ex = make_export(str(tmp_path / "ex"), {B1: 24, B2: 12}, samples_per_shard=6)
    upload_tree(ex.root, root)
    skip_samples(root, "optout", ids=[f"ds/{B1}/{i}" for i in (0, 7, 13)] + [f"ds/{B2}/1"])
    skip_samples(root, "nsfw", ids=[f"ds/{B2}/8"])
    cache = str(tmp_path / "cache")
    _gets(proxy)

    assert _fetch(root, cache) == [B2, B1]
    assert _gets(proxy) == 5 + 2 + 1  # 5 sidecars, 2 indexes, the report
    record = json.load(open(os.path.join(cache, fetched.STATE_NAME)))
    assert len(record["files"]) == 8 and record["root"] == root

    assert _fetch(root, cache) == [B2, B1]
    assert _gets(proxy) == 0  # a second start downloads no unchanged file

    # One more id in a shard that has a sidecar: that sidecar alone is fetched again.
    skip_samples(root, "optout", ids=[f"ds/{B1}/1"])
    _gets(proxy)
    _fetch(root, cache)
    assert _gets(proxy) == 1
    shard = S.read_index(root, B1)[0].basename
    rel = f"{shard}.optout.skip"
    with open(os.path.join(cache, *B1.split("/"), *rel.split("/")), "rb") as f:
        assert f.read() == storage.read_bytes(f"{root}/{B1}/{rel}")

    # A list removed from the export leaves the cache, with nothing downloaded.
    skip_samples(root, "nsfw", remove=True)
    _gets(proxy)
    _fetch(root, cache)
    assert _gets(proxy) == 0
    assert not any(".nsfw." in r for r in _skips(cache, B2)) and _skips(cache, B2)

    # A bucket removed from the export leaves the cache too (its index and sidecars).
    storage.delete(f"{root}/{B2}")
    assert _fetch(root, cache) == [B1]
    assert not os.path.exists(os.path.join(cache, *B2.split("/"), "index.json"))
    assert not _skips(cache, B2)
    record = json.load(open(os.path.join(cache, fetched.STATE_NAME)))
    assert not [r for r in record["files"] if r.startswith(B2)]


def test_reexport_at_the_same_root_is_noticed_through_an_unchanged_index(
    s3_bucket, proxy, tmp_path
):
    """An index without hashes can be byte-identical across exports: the report tells."""
    root = f"s3://{s3_bucket}/ex"
    v1 = make_export(str(tmp_path / "v1"), {B1: 12}, name="v1", samples_per_shard=6, hashes=())
    upload_tree(v1.root, root)
    cache = str(tmp_path / "cache")
    _fetch(root, cache)
    shard = S.read_index(root, B1)[0].basename
    cached = os.path.join(cache, *B1.split("/"), *shard.split("/"))
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached, "wb") as f:  # as a streamed epoch leaves it
        f.write(storage.read_bytes(f"{root}/{B1}/{shard}"))
    _fetch(root, cache)
    assert os.path.exists(cached)  # nothing changed: the shard stays

    v2 = make_export(str(tmp_path / "v2"), {B1: 12}, name="v2", samples_per_shard=6, hashes=())
    assert (
        open(os.path.join(v1.root, B1, "index.json"), "rb").read()
        == open(os.path.join(v2.root, B1, "index.json"), "rb").read()
    )
    upload_tree(v2.root, root)
    _gets(proxy)
    _fetch(root, cache)
    assert _gets(proxy) == 1  # the report; the index is the same bytes
    assert not os.path.exists(cached)  # the stale shard was dropped


def test_a_record_for_another_root_or_a_damaged_one_trusts_nothing(s3_bucket, proxy, tmp_path):
    root = f"s3://{s3_bucket}/ex"
    ex = make_export(str(tmp_path / "ex"), {B1: 12}, samples_per_shard=6)
    upload_tree(ex.root, root)
    skip_samples(root, "optout", ids=[f"ds/{B1}/2"])
    cache = str(tmp_path / "cache")
    _fetch(root, cache)
    _gets(proxy)
    state = os.path.join(cache, fetched.STATE_NAME)
    body = json.load(open(state))
    json.dump({**body, "root": f"s3://{s3_bucket}/other"}, open(state, "w"))
    _fetch(root, cache)
    assert _gets(proxy) == 3
    open(state, "w").write("{not json")
    _fetch(root, cache)
    assert _gets(proxy) == 3
    # A cached copy of another size is fetched again, whatever the record says.
    index = os.path.join(cache, *B1.split("/"), "index.json")
    with open(index, "ab") as f:
        f.write(b" ")
    _fetch(root, cache)
    assert _gets(proxy) == 1
