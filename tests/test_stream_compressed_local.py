"""A local export with compressed shards streams without adding a file to the export.

Streaming decompresses a shard next to its ``.zstd`` when a stream has no
remote; the loader streams such a bucket from the export into a cache
(``DatasetSpec.local``, or a per-export folder under the system temp dir),
so ``verify`` still passes afterwards, skip lists still hold, and a
mid-epoch resume still reproduces the uninterrupted order.
"""

from __future__ import annotations

import os
import shutil

import pytest

from prx_data.export.verify import verify_export
from prx_data.stream import cache as shard_cache
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import make_export, run_rank, skip_samples

B = "512/1.000"
GONE = {f"ds/{B}/{i}" for i in (1, 5, 17)}


def _tree(root: str) -> dict[str, int]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = os.stat(p).st_size
    return out


@pytest.fixture
def zexport(tmp_path):
    ex = make_export(str(tmp_path / "z"), {B: 24}, samples_per_part=8, compression="zstd")
    skip_samples(ex.root, "dedup", ids=GONE)
    return ex


def _ids(run) -> list[str]:
    return [i for batch in run.batches for i in batch]


@pytest.mark.timeout(120)
def test_streaming_writes_only_into_the_cache(zexport, tmp_path):
    from prx_data.cli.verify import check_sidecar

    before = _tree(zexport.root)
    assert any(r.endswith(".mds.zstd") for r in before)
    cache = tmp_path / "cache"
    run = run_rank(
        DatasetSpec(zexport.root, local=str(cache)), rank=0, world_size=1, batch_size=3, tier=512
    )
    assert sorted(_ids(run)) == sorted(set(zexport.ids[B]) - GONE)
    assert _tree(zexport.root) == before  # nothing decompressed next to its .zstd
    raw = [p for p in cache.rglob("shard.*.mds")]
    assert raw, "the decompressed shards are in the cache"
    res = verify_export(zexport.root, deep=True, check_sidecar=check_sidecar)
    assert res.ok, [str(p) for p in res.problems]


@pytest.mark.timeout(120)
def test_without_local_a_per_export_temp_cache_is_used(zexport):
    before = _tree(zexport.root)
    run = run_rank(DatasetSpec(zexport.root), rank=0, world_size=1, batch_size=3, tier=512)
    assert sorted(_ids(run)) == sorted(set(zexport.ids[B]) - GONE)
    assert _tree(zexport.root) == before
    where = shard_cache.default_decompress_dir(zexport.root)
    try:
        assert list(os.scandir(os.path.join(where, *B.split("/"))))
        assert verify_export(zexport.root).ok
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(180)
def test_resume_mid_epoch_matches_the_uninterrupted_order(zexport, tmp_path):
    spec = DatasetSpec(zexport.root, local=str(tmp_path / "cache"))
    kw = dict(rank=0, world_size=1, batch_size=3, tier=512, num_workers=1)
    full = run_rank(spec, **kw)
    first = run_rank(spec, stop_after=2, **kw)
    rest = run_rank(spec, state=first.state, **kw)
    assert first.batches + rest.batches == full.batches


@pytest.mark.timeout(120)
def test_a_reexport_at_the_same_root_drops_the_cached_shards(tmp_path):
    """The cache follows the export: new bytes under old names are never served from it."""
    root, cache = str(tmp_path / "z"), str(tmp_path / "cache")
    make_export(root, {B: 8}, samples_per_part=8, compression="zstd", name="old")
    old = run_rank(DatasetSpec(root, local=cache), rank=0, world_size=1, batch_size=2, tier=512)
    assert {i.split("/")[0] for i in _ids(old)} == {"old"}
    make_export(root, {B: 8}, samples_per_part=8, compression="zstd", name="new")
    new = run_rank(DatasetSpec(root, local=cache), rank=0, world_size=1, batch_size=2, tier=512)
    assert {i.split("/")[0] for i in _ids(new)} == {"new"}


def test_a_cache_inside_the_export_is_refused(zexport):
    from prx_data.core.errors import UsageError

    with pytest.raises(UsageError, match="inside the export"):
        shard_cache.DecompressCache(zexport.root, os.path.join(zexport.root, "cache"))
