"""BucketedDataset on local exports: skip lists in the sample space, resumption, mixing.

Ranks are simulated in this process one after another (tests.exportkit.run_rank):
each simulated rank is its own node, as streaming's partition tests do.
"""

from __future__ import annotations

import collections
import io
import logging
import random

import pytest
import torch

from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec
from prx_data.stream.planner import PlanError
from tests.exportkit import make_export, run_rank, skip_samples

logging.getLogger("streaming").setLevel(logging.ERROR)
B1, B2, B3 = "512/1.000", "512/0.500", "512/2.000"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stream") / "ex")
    ex = make_export(
        root, {B1: 70, B2: 37, B3: 45, "1024/1.000": 9}, samples_per_part=16, samples_per_shard=6
    )
    rng = random.Random(0)
    ids = sorted(ex.all_ids())
    skip_samples(root, "dedup", ids=rng.sample(ids, 14))
    skip_samples(root, "nsfw", ids=rng.sample(ids, 6))
    # One shard with every sample skipped: it must vanish from the sample space.
    bucket, shard, _ = ex.where[f"ds/{B3}/0"]
    n = sum(1 for w in ex.where.values() if w[1] == shard and w[0] == bucket)
    skip_samples(root, "dedup", {(bucket, shard): range(n)})
    return ex


def skipped_ids(ex, names=None):
    out = set()
    for bucket in ex.ids:
        shards = S.read_index(ex.root, bucket)
        for shard, idx in S.load_skips(ex.root, bucket, shards, names).items():
            out |= {
                sid
                for sid, w in ex.where.items()
                if w[0] == bucket and w[1] == shard and w[2] in idx
            }
    return out


def flat(runs):
    return [i for r in runs for b in r.batches for i in b]


def test_exactly_once_across_ranks_and_workers(export):
    kw = dict(tier=512, num_canonical_nodes=2, batching_method="per_stream", small_buckets="drop")
    runs = [
        run_rank(export.root, rank=r, world_size=2, batch_size=4, num_workers=2, **kw)
        for r in range(2)
    ]
    seen = flat(runs)
    counts = collections.Counter(seen)
    assert max(counts.values()) == 1, "a sample was yielded twice"
    skipped = skipped_ids(export)
    assert not set(seen) & skipped, "a skipped sample was yielded"
    assert len({len(r.batches) for r in runs}) == 1, "ranks got different batch counts"
    assert all(len(s) == 1 for r in runs for s in r.shapes), "a batch mixed shapes"
    # Per bucket: everything kept except the planned tail (whole units, 2 ranks x 4 x 2 workers).
    kept = collections.Counter(
        export.where[i][0] for i in export.where if i not in skipped and i.startswith("ds/512")
    )
    got = collections.Counter(export.where[i][0] for i in seen)
    for bucket, n in kept.items():
        assert got[bucket] == (n // 16) * 16
    # Without the lists, the skipped samples come back.
    plain = run_rank(
        DatasetSpec(export.root, skip_lists=[]),
        rank=0,
        world_size=1,
        batch_size=4,
        **{**kw, "num_canonical_nodes": 1},
    )
    assert skipped & set(flat([plain]))


def test_resume_same_world_and_elastic(export):
    """2 ranks stop at batch 3; resume on 2 ranks equals the uninterrupted run; 2 -> 1 -> 4 is exactly once."""
    kw = dict(tier=512, num_canonical_nodes=4, small_buckets="drop")
    spec = DatasetSpec(export.root, skip_lists=["dedup"])
    full = [run_rank(spec, rank=r, world_size=2, batch_size=4, **kw) for r in range(2)]
    first = [
        run_rank(spec, rank=r, world_size=2, batch_size=4, stop_after=3, **kw) for r in range(2)
    ]
    state = first[0].state
    assert state["sample_in_epoch"] == 3 * 8 and state["num_canonical_nodes"] == 4
    again = [
        run_rank(spec, rank=r, world_size=2, batch_size=4, state=state, **kw) for r in range(2)
    ]
    for r in range(2):
        assert first[r].batches + again[r].batches == full[r].batches
    one = run_rank(spec, rank=0, world_size=1, batch_size=8, stop_after=2, state=state, **kw)
    four = [
        run_rank(spec, rank=r, world_size=4, batch_size=2, state=one.state, **kw) for r in range(4)
    ]
    union = flat(first) + flat([one]) + flat(four)
    assert len(union) == len(set(union)) == len(flat(full))
    assert set(union) == set(flat(full))
    assert not set(union) & skipped_ids(export, ["dedup"])
    assert len({len(r.batches) for r in four}) == 1


def test_state_dict_round_trips_through_a_checkpoint(export, tmp_path):
    kw = dict(tier=512, small_buckets="drop")
    a = run_rank(export.root, rank=0, world_size=1, batch_size=4, stop_after=5, **kw)
    buf = io.BytesIO()
    torch.save({"state": {"train_dataloader": a.state}}, buf)  # how Composer stores it
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["state"]["train_dataloader"]
    b = run_rank(export.root, rank=0, world_size=1, batch_size=4, state=state, **kw)
    full = run_rank(export.root, rank=0, world_size=1, batch_size=4, **kw)
    assert a.batches + b.batches == full.batches


def test_proportions_mix_within_tolerance(export, tmp_path):
    # The second export is zstd-compressed and has its own skip list.
    other = make_export(str(tmp_path / "b"), {B1: 40}, name="other", compression="zstd")
    gone = {f"other/{B1}/{i}" for i in (3, 4, 20, 39)}
    skip_samples(other.root, "nsfw", ids=gone)
    specs = [DatasetSpec(export.root, proportion=0.75), DatasetSpec(other.root, proportion=0.25)]
    run = run_rank(
        specs, rank=0, world_size=1, batch_size=4, tier=512, epoch_size=160, small_buckets="drop"
    )
    seen = flat([run])
    share = sum(i.startswith("other/") for i in seen) / len(seen)
    # Rounding each bucket down to whole batches moves the mix by at most one batch per bucket.
    tolerance = 4 * 4 / len(seen)
    assert abs(share - 0.25) <= tolerance, (share, tolerance)
    # 0.25 * 160 = 40 asked of 36 kept samples: upsampled (some twice), never a skipped one.
    from_other = [i for i in seen if i.startswith("other/")]
    assert len(from_other) == 40 and set(from_other) == set(other.ids[B1]) - gone


def test_higher_tier_is_downsized_and_item_fields(export):
    from prx_data.stream.dataset import BucketedDataset

    plain = DatasetSpec(export.root, skip_lists=[])
    run = run_rank(
        plain,
        rank=0,
        world_size=1,
        batch_size=2,
        tier=512,
        include_higher_tiers=True,
        small_buckets="drop",
    )
    from_1024 = [i for i in flat([run]) if i.startswith("ds/1024/")]
    assert len(from_1024) == 8  # 9 samples, whole batches of 2
    ds = BucketedDataset(
        plain,
        tier=512,
        include_higher_tiers=True,
        batch_size=2,
        small_buckets="drop",
        shuffle=False,
    )
    try:
        idx = next(i for i in range(ds.num_samples) if ds[i]["source_bucket"] == "1024/1.000")
        item = ds[idx]
        assert item["image"].shape == (3, 512, 512) and item["image"].dtype == torch.uint8
        assert (item["tier"], item["bucket"], item["width"]) == (512, "512/1.000", 2048)
        assert item["caption"] == f"caption of {item['id']}"
        # Every item names its dataset: by default the root's last two path parts.
        assert item["dataset"] == "/".join(export.root.rstrip("/").split("/")[-2:])
        assert ds.plan.datasets == [item["dataset"]] and item["dataset"] in ds.plan.report()
        n = int(item["id"].rsplit("/", 1)[1])
        assert abs(int(item["image"][0, 256, 256]) - n % 251) <= 3  # the colour survives the resize
    finally:
        del ds


def test_errors_are_clear(export, tmp_path):
    import shutil

    from prx_data.stream.dataset import BucketedDataset

    with pytest.raises(S.SkipListError, match=r"\['typo'\] not found"):
        run_rank(
            DatasetSpec(export.root, skip_lists=["typo"]),
            rank=0,
            world_size=1,
            batch_size=2,
            tier=512,
        )
    with pytest.raises(PlanError, match="pass num_workers=1"):
        _workers_mismatch(export)
    ds_state = {
        "epoch": 0,
        "sample_in_epoch": 8,
        "num_canonical_nodes": 3,
        "shuffle_seed": 9176,
        "initial_physical_nodes": 1,
    }
    with pytest.raises(PlanError, match="num_canonical_nodes=3"):
        run_rank(
            export.root,
            rank=0,
            world_size=1,
            batch_size=2,
            tier=512,
            state=ds_state,
            small_buckets="drop",
        )
    # A corrupt sidecar stops the dataset with the file's name.
    root = str(tmp_path / "c")
    shutil.copytree(export.root, root)
    bucket, shard, _ = export.where[f"ds/{B1}/3"]
    skip_samples(root, "late", {(bucket, shard): [0]})
    path = f"{root}/{bucket}/{shard}.late.skip"
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(S.SkipListError, match=r"late\.skip: checksum"):
        BucketedDataset(root, tier=512, batch_size=2, small_buckets="drop")


def _workers_mismatch(export):
    from torch.utils.data import DataLoader

    from prx_data.stream.dataset import BucketedDataset

    ds = BucketedDataset(export.root, tier=512, batch_size=2, small_buckets="drop", num_workers=4)
    try:
        next(iter(DataLoader(ds, batch_size=2, num_workers=0)))
    finally:
        del ds


def test_replication_gives_identical_batches_to_a_group(export):
    kw = dict(tier=512, small_buckets="drop", replication=2, num_canonical_nodes=1)
    runs = [run_rank(export.root, rank=r, world_size=2, batch_size=4, **kw) for r in range(2)]
    assert runs[0].batches == runs[1].batches and runs[0].batches


def test_dataset_names_default_to_the_roots_last_parts():
    from prx_data.stream.spec import default_name

    assert default_name("s3://bucket/exports/v1/") == "exports/v1"
    assert default_name("/data/ex") == "data/ex" and default_name("ex") == "ex"
    assert DatasetSpec("/a/b/c", name="photos").label == "photos"
    assert DatasetSpec("/a/b/c").label == "b/c"
