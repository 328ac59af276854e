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
    assert "dropped at bucket tails" in p.report()


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
