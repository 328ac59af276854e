"""``skips rewrite`` streams shard by shard with its local disk under a bound.

Remote roots live on the session's moto server (loopback). A monitor on the
rewrite's staging hook measures the real bytes on disk after every staged
write; the bound is set to a few shards of an export many times that size.
"""

from __future__ import annotations

import json
import os

import pytest

from prx_data.cli.skips import main
from prx_data.core import storage
from prx_data.export import layout
from prx_data.skips import rewrite as R
from prx_data.skips import sidecar as S
from tests.exportkit import make_export, skip_samples, upload_tree

pytestmark = pytest.mark.remote
B1, B2 = "512/1.000", "512/0.500"


def _disk(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(directory)
        for f in files
        if os.path.exists(os.path.join(d, f))
    )


class DiskMonitor:
    """Test hook: the bytes under the staging directory after each staged write."""

    def __init__(self, monkeypatch) -> None:
        self.peak = 0
        self.writes = 0
        self.limits: set[int] = set()
        monitor = self

        def written(staging, path):  # replaces the no-op hook
            monitor.writes += 1
            monitor.limits.add(staging.limit)
            monitor.peak = max(monitor.peak, _disk(staging.directory))

        monkeypatch.setattr(R.Staging, "written", written)


def _export(tmp_path, **kw):
    ex = make_export(
        str(tmp_path / "src"), {B1: 40, B2: 24}, samples_per_part=16, samples_per_shard=6, **kw
    )
    skip_samples(ex.root, "dedup", ids=[f"ds/{B1}/{i}" for i in range(0, 40, 3)])
    skip_samples(ex.root, "optout", ids=[f"ds/{B2}/{i}" for i in (1, 2, 20)])
    return ex


def _largest_shard(root: str) -> int:
    return max(s.bytes for b in layout.list_buckets(root) for s in S.read_index(root, b))


def _remote(s3_bucket: str, name: str) -> str:
    return f"s3://{s3_bucket}/{name}"


def test_remote_to_remote_stays_under_the_bound_and_matches_a_local_rewrite(
    s3_bucket, tmp_path, monkeypatch
):
    ex = _export(tmp_path)
    src = _remote(s3_bucket, "src")
    upload_tree(ex.root, src)
    total = sum(storage.file_sizes(ex.root).values())
    largest = _largest_shard(ex.root)
    # Three shards' room (one source, one output and its check) plus the part's metadata.
    bound = 3 * largest + (16 << 10)
    assert total > 3 * bound  # the whole source could never be staged

    local = R.rewrite_export(ex.root, str(tmp_path / "local"), names=["dedup"], force=True)
    monitor = DiskMonitor(monkeypatch)
    out = _remote(s3_bucket, "out")
    r = R.rewrite_export(src, out, names=["dedup"], force=True, max_local=bound)

    assert monitor.writes > 20 and monitor.limits == {bound}
    assert 0 < monitor.peak <= bound
    assert r.verified and r.samples_out == local.samples_out == 64 - 14
    # The same tree as a local rewrite, byte for byte (shards, indexes, manifests).
    assert layout.content_digest(out) == layout.content_digest(str(tmp_path / "local"))
    # Lifecycle: the applied list left, the other one was carried by id, the report came last.
    assert S.list_skip_lists(out).keys() == {"optout"}
    assert r.lists_carried["optout"]["samples"] == 3
    assert json.loads(storage.read_bytes(f"{out}/report.json"))["samples_written"] == 50


def test_compressed_local_source_to_remote_is_checked_and_bounded(s3_bucket, tmp_path, monkeypatch):
    ex = _export(tmp_path, compression="zstd")
    largest = _largest_shard(ex.root)
    bound = 4 * largest + (16 << 10)  # a compressed output shard is checked decompressed
    monitor = DiskMonitor(monkeypatch)
    out = _remote(s3_bucket, "zout")
    r = R.rewrite_export(ex.root, out, force=True, max_local=bound)
    assert r.verified and r.samples_out == 64 - 17
    assert 0 < monitor.peak <= bound
    local = R.rewrite_export(ex.root, str(tmp_path / "zlocal"), force=True)
    assert layout.content_digest(out) == layout.content_digest(local.out)


def test_a_shard_that_cannot_fit_is_refused_before_anything_is_written(s3_bucket, tmp_path, capsys):
    ex = _export(tmp_path)
    src = _remote(s3_bucket, "src")
    upload_tree(ex.root, src)
    out = _remote(s3_bucket, "small")
    args = ["rewrite", src, out, "--force", "--max-local-bytes", "1k"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "raise --max-local-bytes" in err
    assert not storage.exists(out)


def test_disk_setting_from_the_environment(monkeypatch):
    monkeypatch.setenv(R.DISK_ENV, "1.5G")
    assert R.max_local_bytes() == 3 << 29
    assert R.max_local_bytes("500M") == 500 << 20
    monkeypatch.setenv(R.DISK_ENV, "lots")
    with pytest.raises(ValueError, match="PRX_REWRITE_DISK 'lots' is not a positive size"):
        R.max_local_bytes()
    monkeypatch.delenv(R.DISK_ENV)
    assert R.max_local_bytes() == R.DEFAULT_MAX_LOCAL_BYTES


@pytest.mark.faults
def test_a_rewrite_killed_mid_bucket_leaves_no_complete_tree_and_no_staged_bytes(
    s3_bucket, tmp_path, monkeypatch
):
    ex = _export(tmp_path)
    src = _remote(s3_bucket, "src")
    upload_tree(ex.root, src)
    work = tmp_path / "work"
    work.mkdir()
    real = storage.read_bytes
    shard_reads = []

    def failing(path: str, **kw) -> bytes:  # test double: the store fails at the 5th shard
        if path.endswith(".mds"):
            shard_reads.append(path)
            if len(shard_reads) == 5:
                raise ConnectionError("injected")
        return real(path, **kw)

    monkeypatch.setattr(storage, "read_bytes", failing)
    out = _remote(s3_bucket, "killed")
    with pytest.raises(ConnectionError):
        R.rewrite_export(src, out, force=True, work_dir=str(work))
    assert not layout.is_complete(out)
    assert os.listdir(work) == []  # the staged bytes went with it
    # A later rewrite refuses the unfinished tree rather than mixing with it.
    monkeypatch.setattr(storage, "read_bytes", real)
    with pytest.raises(FileExistsError, match="not empty"):
        R.rewrite_export(src, out, force=True)
