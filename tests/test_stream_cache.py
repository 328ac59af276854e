"""A node's shard cache over a corpus that changes: never stale bytes, never the export's files.

Remote roots live on the session's moto server (loopback). Each test streams the
way a training job does (``run_rank``), changes the corpus the way a user does
(a re-export at the same root, an opt-out, a cache limit over a mixed dataset),
and streams again.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest

from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import make_export, run_rank, skip_samples, upload_tree

pytestmark = pytest.mark.remote
logging.getLogger("streaming").setLevel(logging.ERROR)
B1 = "512/1.000"
SMOKE = Path(__file__).resolve().parents[1] / "configs" / "train" / "smoke_cpu.yaml"


def _bucket(moto_server: str) -> str:
    import boto3

    name = f"prx-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=name)
    return name


def _stream(spec, **kw) -> list[str]:
    run = run_rank(spec, rank=0, world_size=1, batch_size=4, tier=512, **kw)
    return [i for b in run.batches for i in b]


def _shard_files(root: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
        if ".mds" in f and not f.endswith(".skip")
    }


def test_warm_cache_after_reexport_streams_the_new_bytes(moto_server, tmp_path):
    """Same root, same part and shard names, same shard sizes: only the bytes differ."""
    root = f"s3://{_bucket(moto_server)}/ex"
    cache = str(tmp_path / "cache")
    old = make_export(str(tmp_path / "v1"), {B1: 24}, name="v1", samples_per_shard=6)
    upload_tree(old.root, root)
    assert sorted(_stream(DatasetSpec(root, local=cache))) == sorted(old.all_ids())

    # Re-export (a re-caption) over the same root, then opt one sample out of the new export.
    new = make_export(str(tmp_path / "v2"), {B1: 24}, name="v2", samples_per_shard=6)
    # The same part and shard names, and the same sizes: only the bytes differ.
    assert S.read_index(old.root, B1) == S.read_index(new.root, B1)
    upload_tree(new.root, root)
    out = "v2/512/1.000/3"
    assert skip_samples(root, "optout", ids=[out]).samples_listed == 1

    seen = _stream(DatasetSpec(root, local=cache))
    # 23 kept samples stream as 5 whole batches of 4, every one from the new export.
    assert len(seen) == len(set(seen)) == 20 and set(seen) <= new.all_ids() - {out}


def test_cache_limit_over_remote_and_local_never_deletes_the_local_export(moto_server, tmp_path):
    root = f"s3://{_bucket(moto_server)}/ex"
    remote = make_export(str(tmp_path / "r"), {B1: 16}, name="r", samples_per_shard=2)
    upload_tree(remote.root, root)
    local = make_export(str(tmp_path / "l"), {B1: 16}, name="l", samples_per_shard=2)
    before = _shard_files(local.root)
    assert len(before) == 8
    size = max(
        os.path.getsize(os.path.join(local.root, f)) for f in before
    )  # shards of both exports are the same size
    optout = {f"l/{B1}/{i}" for i in (1, 2, 5, 9)}  # skip-aware shard readers are pinned too
    skip_samples(local.root, "optout", ids=sorted(optout))
    specs = [DatasetSpec(root, local=str(tmp_path / "cache")), DatasetSpec(local.root)]
    seen = _stream(specs, cache_limit=5 * size + 4096, shuffle=True)
    # Not one file of the local export was deleted, and the whole epoch streamed.
    assert _shard_files(local.root) == before
    assert sorted(seen) == sorted(remote.all_ids() | local.all_ids() - optout)
    # The limit held on the remote stream's cache: it evicted to stay under it.
    assert len(_shard_files(str(tmp_path / "cache"))) < 8


def test_eval_slice_on_a_remote_root_starts_next_to_training(moto_server, tmp_path):
    """Training and the eval hold-out read one remote root in one process, each with a cache."""
    from prx_data.train.config import load_config
    from prx_data.train.data import build_dataset
    from prx_data.train.evaluation import build_evaluator, holdout_for

    root = f"s3://{_bucket(moto_server)}/ex"
    ex = make_export(str(tmp_path / "ex"), {B1: 24}, samples_per_shard=6)
    upload_tree(ex.root, root)
    cfg = load_config(
        SMOKE,
        [
            f"variables.data_root={root}",
            f"data.datasets.0.local={tmp_path / 'cache'}",
            "data.plan.include_higher_tiers=false",
            "data.global_batch_size=1",
            "eval.holdout_fraction=0.25",
        ],
    )
    train = build_dataset(cfg.data, 1, holdout=holdout_for(cfg, "train"))
    held = build_evaluator(cfg, 1, cfg.model.patch_size).dataloader.dataloader.dataset
    # Streaming's "Reused local directory" check depends on what else holds shared memory on
    # the host, so check the cause too: no cache directory is shared.
    assert not {s.local for s in train.streams} & {s.local for s in held.streams}
    train_ids = [train[i]["id"] for i in range(train.num_samples)]
    held_ids = [held[i]["id"] for i in range(held.num_samples)]
    assert held_ids and not set(train_ids) & set(held_ids)
    assert sorted(train_ids + held_ids) == sorted(ex.all_ids())


def test_a_cached_shard_is_kept_only_while_it_matches_its_index_entry(tmp_path):
    """The check behind the warm-cache test, case by case: a stat per shard, no rehashing."""
    from prx_data.stream.cache import drop_stale_shards

    def entry(name: str, nbytes: int = 100, xxh: str | None = "aa") -> dict:
        hashes = {"xxh64": xxh} if xxh else {}
        return {"raw_data": {"basename": name, "bytes": nbytes, "hashes": hashes}, "samples": 4}

    def cache(*names: str) -> str:
        d = tmp_path / uuid.uuid4().hex
        for n in names:
            (d / n).parent.mkdir(parents=True, exist_ok=True)
            (d / n).write_bytes(b"x")
        (tmp_path / "outside.mds").write_bytes(b"mine")
        return str(d)

    def left(d: str) -> set[str]:
        return _shard_files(d)

    a, b = "p/shard.00000.mds", "p/shard.00001.mds"
    old = {a: entry(a), b: entry(b)}
    # Same entries with hashes: kept, whatever the report says.
    d = cache(a, b)
    assert drop_stale_shards(d, old, [entry(a), entry(b)], same_report=False) == 0
    assert left(d) == {a, b}
    # Another hash (a re-export at the same size), another size, a shard gone from the index.
    d = cache(a, b)
    assert drop_stale_shards(d, old, [entry(a, xxh="bb")], same_report=True) == 2
    d = cache(a, b)
    assert drop_stale_shards(d, old, [entry(a), entry(b, nbytes=101)], same_report=True) == 1
    assert left(d) == {a}
    # No hash in the index: only the export's report dates the bytes.
    plain = {a: entry(a, xxh=None)}
    d = cache(a)
    assert drop_stale_shards(d, plain, [entry(a, xxh=None)], same_report=True) == 0
    assert drop_stale_shards(d, plain, [entry(a, xxh=None)], same_report=False) == 1
    # An untracked cache (older version, or unknown origin) is never trusted.
    d = cache(a, b)
    assert drop_stale_shards(d, None, [entry(a), entry(b)], same_report=True) == 2
    # A name that leaves the bucket directory is never followed.
    d = cache(a)
    escape = {"../outside.mds": entry("../outside.mds")}
    drop_stale_shards(d, escape, [entry(a)], same_report=True)
    assert (tmp_path / "outside.mds").read_bytes() == b"mine"


def test_predownload_is_bounded_by_what_the_cache_holds():
    """A look-ahead past the cache limit can evict the shard the reader waits for: a hang."""
    from prx_data.stream.cache import predownload_within_cache as bound

    assert bound(10_000, 1_000, 1, None) == 8  # 10 shards fit: read one, 8 ahead (+1 spare)
    assert bound(10_000, 1_000, 2, None) == 3  # each worker looks ahead on its own
    assert bound(10_000, 1_000, 1, 4) == 4  # the user's setting is kept when it fits
    with pytest.raises(ValueError, match="predownload <= 8"):
        bound(10_000, 1_000, 1, 64)  # streaming's default at batch 8 would thrash and stall
    with pytest.raises(ValueError, match="at least 12000 bytes"):
        bound(5_000, 1_000, 4, None)


def test_cache_limit_lowers_the_default_look_ahead(moto_server, tmp_path):
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream.dataset import BucketedDataset

    root = f"s3://{_bucket(moto_server)}/ex"
    remote = make_export(str(tmp_path / "r"), {B1: 16}, name="r", samples_per_shard=2)
    upload_tree(remote.root, root)
    clean_stale_shared_memory()
    spec = DatasetSpec(root, local=str(tmp_path / "cache"))
    ds = BucketedDataset(spec, tier=512, batch_size=4, cache_limit="64mb")
    assert ds.predownload == 4 * 8  # streaming's default (8 x batch) fits in 64 MB: kept
    del ds
    clean_stale_shared_memory()
    size = max(r.get_max_size() for r in BucketedDataset(spec, tier=512, batch_size=4).shards)
    clean_stale_shared_memory()
    ds = BucketedDataset(spec, tier=512, batch_size=4, cache_limit=6 * size)
    assert ds.predownload == 4  # 6 shards fit: one read, four ahead, one spare
    del ds
    clean_stale_shared_memory()
    with pytest.raises(ValueError, match="predownload"):
        BucketedDataset(spec, tier=512, batch_size=4, cache_limit=6 * size, predownload=32)
