"""Bucket planner: units, tails, weights and the configurations it refuses."""

from __future__ import annotations

import math

import pytest

from prx_data.stream.planner import BucketCount, DatasetCount, PlanError, plan_buckets


def ds(name="a", *counts, **w):
    return DatasetCount(
        name, [BucketCount(f"512/{i}.000", n, s) for i, (n, s) in enumerate(counts)], **w
    )


def test_unit_and_tails_per_stream():
    p = plan_buckets(
        [ds("a", (100, 3), (40, 0))],
        device_batch_size=4,
        world_size=4,
        num_nodes=2,
        num_workers=2,
        num_canonical_nodes=4,
    ).check()
    assert p.global_batch_size == 16 and p.unit == math.lcm(4, 16 * 2) == 32
    b0, b1 = p.buckets
    assert (b0.kept, b0.choose, b0.dropped, b0.batches) == (97, 96, 1, 6)
    assert (b1.choose, b1.dropped) == (32, 8)
    assert p.epoch_size == 128 and p.batches_per_rank == 8
    assert all(b.choose % p.unit == 0 for b in p.buckets)
    assert "9 of 137 kept samples not reached this epoch" in p.report()


def test_device_per_stream_unit_depends_on_ranks_per_node():
    p = plan_buckets(
        [ds("a", (1000, 0))],
        device_batch_size=4,
        world_size=4,
        num_nodes=2,
        num_workers=3,
        num_canonical_nodes=2,
        batching_method="device_per_stream",
    )
    assert p.unit == math.lcm(2 * 2 * 3, 16)


def test_small_bucket_is_fatal_or_dropped():
    counts = [ds("a", (100, 0), (10, 2))]
    with pytest.raises(PlanError, match=r"512/1.000 has 8 samples.*small_buckets='drop'"):
        plan_buckets(counts, device_batch_size=16).check()
    p = plan_buckets(counts, device_batch_size=16, small_buckets="drop").check()
    assert p.buckets[1].excluded and p.buckets[1].dropped == 8 and p.epoch_size == 96


def test_fill_streams_small_buckets_only_when_nothing_else_would():
    # The eval side of a small hold-out: one or two samples per bucket, two ranks.
    small = [ds("a", (1, 0), (2, 1), (0, 0))]
    with pytest.raises(PlanError, match="nothing to train on"):
        plan_buckets(small, device_batch_size=1, world_size=2, small_buckets="drop").check()
    p = plan_buckets(small, device_batch_size=1, world_size=2, small_buckets="fill").check()
    assert [b.choose for b in p.buckets] == [2, 2, 0]
    assert [b.excluded for b in p.buckets] == [False, False, False]
    assert p.batches_per_rank == 2 and p.mix[0].planned == 4
    assert len(p.warnings) == 1 and "2 of 4 samples drawn twice" in p.warnings[0]
    # A bucket with a whole unit: "fill" plans exactly as "drop" does (no repeats).
    big = [ds("a", (10, 0), (1, 0))]
    fill = plan_buckets(big, device_batch_size=1, world_size=2, small_buckets="fill")
    drop = plan_buckets(big, device_batch_size=1, world_size=2, small_buckets="drop")
    assert [b.choose for b in fill.buckets] == [b.choose for b in drop.buckets] == [10, 0]
    assert fill.warnings == drop.warnings


def test_canonical_node_mismatch_is_refused():
    with pytest.raises(PlanError, match="one must divide the other"):
        plan_buckets(
            [ds("a", (1000, 0))],
            device_batch_size=2,
            world_size=3,
            num_nodes=3,
            num_canonical_nodes=2,
        ).check()
    with pytest.raises(PlanError, match="divisible by the number of physical nodes"):
        plan_buckets(
            [ds("a", (1000, 0))],
            device_batch_size=2,
            world_size=4,
            num_nodes=4,
            num_canonical_nodes=2,
            batching_method="device_per_stream",
        ).check()


def test_unsupported_batching_and_weights():
    with pytest.raises(PlanError, match="one shape per batch"):
        plan_buckets([ds("a", (10, 0))], device_batch_size=1, batching_method="random")
    with pytest.raises(PlanError, match="cannot be mixed"):
        plan_buckets([ds("a", (10, 0), proportion=1.0), ds("b", (10, 0))], device_batch_size=1)
    with pytest.raises(PlanError, match="replication"):
        plan_buckets(
            [ds("a", (10, 0))], device_batch_size=1, world_size=3, num_nodes=1, replication=2
        )


def test_proportions_split_by_dataset_then_bucket_size():
    p = plan_buckets(
        [ds("a", (600, 0), (200, 0), proportion=3), ds("b", (100, 0), proportion=1)],
        device_batch_size=10,
        epoch_size=4000,
    ).check()
    by = {(p.datasets[b.dataset], b.bucket): b.choose for b in p.buckets}
    assert by == {("a", "512/0.000"): 2250, ("a", "512/1.000"): 750, ("b", "512/0.000"): 1000}


def test_repeat_choose_and_replication():
    p = plan_buckets(
        [ds("a", (100, 20), repeat=2.0), ds("b", (50, 0), choose=30)],
        device_batch_size=5,
        world_size=4,
        replication=2,
    ).check()
    assert p.global_batch_size == 10  # two replica groups of two ranks
    assert [b.target for b in p.buckets] == [160, 30]
    assert [b.choose for b in p.buckets] == [160, 30]


def test_shuffle_block_share_must_not_round_to_zero():
    with pytest.raises(PlanError, match="shuffle_block_size>="):
        plan_buckets(
            [ds("a", (100_000, 0), (8, 0))], device_batch_size=8, shuffle_block_size=10
        ).check()


def test_cli_reports_and_fails_on_fatal_configs(tmp_path, capsys):
    from prx_data.cli.planner import main
    from tests.exportkit import make_export

    root = make_export(str(tmp_path / "ex"), {"512/1.000": 20, "512/0.500": 6}).root
    assert main([root, "--tier", "512", "--batch-size", "8"]) == 2
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "512/0.500 has 6 samples" in out
    assert main([root, "--tier", "512", "--batch-size", "8", "--small-buckets", "drop"]) == 0
    out = capsys.readouterr().out
    assert "epoch: 16 samples, 2 batches per rank" in out


# --- dataset-level allocation -----------------------------------------------------------------


def skewed(name, total, n_buckets=13, ratio=0.6, tiny=(), **w):
    """``total`` samples over ``n_buckets`` buckets, each ``ratio`` times the previous."""
    raw = [ratio**i for i in range(n_buckets)]
    counts = [int(total * r / sum(raw)) for r in raw]
    counts[0] += total - sum(counts)
    for i, n in tiny:
        counts[0] += counts[i] - n
        counts[i] = n
    return DatasetCount(name, [BucketCount(f"512/b{i:02d}", n) for i, n in enumerate(counts)], **w)


def shares(p):
    return {d.name: d.realised(p.epoch_size) for d in p.mix}


@pytest.mark.parametrize("workers", [1, 8])
def test_large_mix_holds_its_proportions(workers):
    """0.7 / 0.3 of 200k + 20k samples over 13 skewed buckets each, global batch 1024."""
    a = skewed("a", 200_000, proportion=0.7)
    b = skewed("b", 20_000, ratio=0.45, proportion=0.3)  # its last buckets hold a few samples
    assert min(x.kept for x in b.buckets) < 10
    p = plan_buckets(
        [a, b], device_batch_size=128, world_size=8, num_workers=workers, small_buckets="drop"
    ).check()
    assert p.unit == 1024 * workers
    s = shares(p)
    assert abs(s["a"] - 0.7) <= 0.01 and abs(s["b"] - 0.3) <= 0.01, s
    # The epoch is about the size of the data, not a fraction of it.
    assert abs(p.epoch_size - 220_000) <= p.unit
    assert all(x.choose % p.unit == 0 for x in p.buckets)
    # Each dataset is within one unit of its target.
    for d in p.mix:
        assert abs(d.planned - d.target) <= p.unit
    # The mix table says so.
    assert "0.7000" in p.mix_report() and "0.3000" in p.mix_report()


def test_downsampled_dataset_never_repeats_and_upsampled_one_spreads():
    a = skewed("a", 200_000, proportion=0.7)
    b = skewed("b", 20_000, proportion=0.3)
    p = plan_buckets([a, b], device_batch_size=1024, small_buckets="drop").check()
    for x in p.buckets:
        if p.datasets[x.dataset] == "a":
            assert x.choose <= x.kept  # downsampled: no sample twice
        elif not x.excluded:
            # up-sampled about 3.3x everywhere, each bucket within one unit of its share
            assert abs(x.choose - x.target) <= p.unit


def test_tiny_buckets_are_left_out_with_a_warning_naming_the_loss():
    a = skewed("a", 5_000, n_buckets=5, tiny=[(3, 7), (4, 2)], proportion=0.5)
    b = skewed("b", 5_000, n_buckets=3, proportion=0.5)
    with pytest.raises(PlanError, match=r"a:512/b03 has 7 samples"):
        plan_buckets([a, b], device_batch_size=64).check()
    p = plan_buckets([a, b], device_batch_size=64, small_buckets="drop").check()
    left_out = [x for x in p.buckets if x.excluded]
    assert [(x.bucket, x.dropped) for x in left_out] == [("512/b03", 7), ("512/b04", 2)]
    text = "\n".join(p.warnings)
    assert "a:512/b03: 7 samples left out" in text and "Realised shares: a 0.5" in text
    # Their share went to the dataset's other buckets.
    assert abs(shares(p)["a"] - 0.5) <= p.unit / p.epoch_size


def test_a_bucket_of_at_least_half_a_unit_is_upsampled_to_one():
    # 40 samples, unit 64: up-sampled to one unit (24 repeats), not left out.
    p = plan_buckets(
        [
            DatasetCount(
                "a", [BucketCount("512/1.000", 1000), BucketCount("512/0.500", 40)], repeat=1.0
            )
        ],
        device_batch_size=64,
    ).check()
    big, small = p.buckets
    assert (small.choose, small.repeated, small.excluded) == (64, 24, False)
    assert big.choose + small.choose == 1024  # round(1040 / 64) units
    assert "up-sampled" in p.report()


@pytest.mark.parametrize(
    ("weights", "want"),
    [
        (({"repeat": 2.0}, {"repeat": 0.5}), (218, 64)),  # 109 x 2, 128 x 0.5
        (({"choose": 140}, {"choose": 60}), (140, 60)),
    ],
)
def test_repeat_and_choose_within_one_global_batch(weights, want):
    a = DatasetCount(
        "a",
        [BucketCount("512/1.000", 61), BucketCount("512/0.500", 40), BucketCount("512/2.000", 8)],
        **weights[0],
    )
    b = DatasetCount(
        "b", [BucketCount("512/1.000", 100), BucketCount("512/0.500", 28)], **weights[1]
    )
    p = plan_buckets([a, b], device_batch_size=4, num_workers=2, small_buckets="drop").check()
    gbs = p.global_batch_size
    got = [d.planned for d in p.mix]
    assert all(abs(g - w) <= gbs for g, w in zip(got, want, strict=True)), (got, want)
    requested = [w / sum(want) for w in want]
    assert all(abs(d.requested - r) < 1e-9 for d, r in zip(p.mix, requested, strict=True))


def test_unweighted_dataset_is_exactly_once():
    p = plan_buckets([skewed("a", 10_000, n_buckets=6)], device_batch_size=32).check()
    assert all(x.choose == x.kept // 32 * 32 and x.repeated == 0 for x in p.buckets)


def test_large_plan_json_has_every_field(tmp_path):
    p = plan_buckets(
        [skewed("a", 20_000, proportion=0.7), skewed("b", 2_000, proportion=0.3)],
        device_batch_size=16,
        small_buckets="drop",
    )
    d = p.to_dict()
    assert d["epoch_size"] == p.epoch_size and d["unit"] == 16
    for ds_ in d["datasets"]:
        assert {"requested", "realised", "samples", "buckets"} <= set(ds_)
        for b in ds_["buckets"]:
            assert {"samples", "skipped", "planned", "dropped"} <= set(b)
    assert sum(b["planned"] for x in d["datasets"] for b in x["buckets"]) == p.epoch_size


def test_mix_drift_is_warned():
    # One unit of 1024 cannot express 0.98 / 0.02 of 4096 samples.
    p = plan_buckets(
        [
            skewed("a", 2048, n_buckets=1, proportion=0.98),
            skewed("b", 2048, n_buckets=1, proportion=0.02),
        ],
        device_batch_size=1024,
        small_buckets="drop",
    ).check()
    assert any(
        "b: realised share 0.0000 differs from the requested 0.0200" in w for w in p.warnings
    )
    assert any("'b': its weight asks for 82 samples" in w for w in p.warnings)


def test_cli_json_writes_the_plan(tmp_path, capsys):
    import json

    from prx_data.cli.planner import main
    from tests.exportkit import make_export

    a = make_export(str(tmp_path / "a"), {"512/1.000": 40, "512/0.500": 12}, name="a").root
    b = make_export(str(tmp_path / "b"), {"512/1.000": 20}, name="b").root
    out = tmp_path / "plan.json"
    code = main(
        [
            f"{a}=0.7",
            f"{b}=0.3",
            "--tier",
            "512",
            "--batch-size",
            "4",
            "--small-buckets",
            "drop",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "requested" in text and "realised" in text
    plan = json.loads(out.read_text())
    assert [round(d["requested"], 2) for d in plan["datasets"]] == [0.7, 0.3]
    assert abs(plan["datasets"][1]["realised"] - 0.3) <= 4 / plan["epoch_size"]
    assert plan["unit"] == 4 and plan["epoch_size"] == 72
