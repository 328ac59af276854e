"""Mixing through BucketedDataset, and resumes onto a changed sample space.

Ranks are simulated in this process (tests.exportkit.run_rank), one rank per node.
"""

from __future__ import annotations

import collections
import logging
import random

import pytest

from prx_data.stream.dataset import DatasetSpec, ResumeMismatch
from tests.exportkit import make_export, run_rank, skip_samples

logging.getLogger("streaming").setLevel(logging.ERROR)

#: Skewed: most samples in one bucket, a few in others (one of them tiny).
A_BUCKETS = {"512/1.000": 61, "512/0.500": 40, "512/2.000": 8}  # 109
B_BUCKETS = {"512/1.000": 100, "512/0.778": 28}  # 128


def flat(runs):
    return [i for r in runs for b in r.batches for i in b]


@pytest.fixture()
def two(tmp_path):
    a = make_export(str(tmp_path / "a"), A_BUCKETS, name="a", samples_per_shard=7)
    b = make_export(str(tmp_path / "b"), B_BUCKETS, name="b", samples_per_shard=7)
    return a, b


def _share(ids, name):
    return sum(i.startswith(name + "/") for i in ids)


@pytest.mark.parametrize(
    ("weights", "want_a"),
    [
        ({"proportion": (0.7, 0.3)}, None),
        ({"repeat": (2.0, 0.5)}, 218),  # 109 x 2 of a, 64 of b
        ({"choose": (140, 60)}, 140),
    ],
)
def test_mix_is_within_one_global_batch(two, weights, want_a):
    ((key, (wa, wb)),) = weights.items()
    a, b = two
    specs = [DatasetSpec(a.root, **{key: wa}), DatasetSpec(b.root, **{key: wb})]
    workers = 2 if key == "proportion" else 0
    run = run_rank(
        specs,
        rank=0,
        world_size=1,
        batch_size=4,
        num_workers=workers,
        tier=512,
        small_buckets="drop",
    )
    seen = flat([run])
    gbs = 4
    n_a, n_b = _share(seen, "a"), _share(seen, "b")
    if key == "proportion":
        assert abs(n_a - 0.7 * len(seen)) <= gbs and abs(n_b - 0.3 * len(seen)) <= gbs
        assert abs(len(seen) - 237) <= 8  # about the whole data, not a fraction of it
    else:
        assert abs(n_a - want_a) <= gbs and abs(n_b - (wb * 128 if key == "repeat" else wb)) <= gbs
    assert all(len(s) == 1 for s in run.shapes), "a batch mixed shapes"


def _first_two_ranks(root, stop_after=2, **kw):
    return [
        run_rank(root, rank=r, world_size=2, batch_size=4, stop_after=stop_after, **kw)
        for r in range(2)
    ]


KW = dict(tier=512, num_canonical_nodes=4, small_buckets="drop")


def test_an_opt_out_added_since_the_checkpoint_is_refused_by_default(two):
    a, _ = two
    first = _first_two_ranks(a.root, **KW)
    state = first[0].state
    assert state["prx_fingerprint"]["datasets"][0]["skip_lists"] == {}
    gone = random.Random(3).sample(sorted(a.all_ids()), 9)
    skip_samples(a.root, "optout", ids=gone)
    with pytest.raises(ResumeMismatch) as err:
        run_rank(a.root, rank=0, world_size=1, batch_size=8, state=state, **KW)
    msg = str(err.value)
    assert "skip list 'optout' added since the checkpoint (9 samples in this tier)" in msg
    assert "on_change='restart_epoch'" in msg and "the 16 samples already trained" in msg


def test_restart_epoch_applies_the_opt_out_and_sees_every_other_sample_once(two):
    a, _ = two
    first = _first_two_ranks(a.root, **KW)
    trained = set(flat(first))
    gone = set(random.Random(4).sample(sorted(a.all_ids()), 9))
    skip_samples(a.root, "optout", ids=gone)
    # Resume on 4 ranks (global batch 8 kept), then on 1.
    four = [
        run_rank(
            a.root,
            rank=r,
            world_size=4,
            batch_size=2,
            state=first[0].state,
            stop_after=3,
            on_change="restart_epoch",
            **KW,
        )
        for r in range(4)
    ]
    # The second resume has the new lists in its checkpoint: it continues silently.
    one = run_rank(a.root, rank=0, world_size=1, batch_size=8, state=four[0].state, **KW)
    after = flat(four) + flat([one])
    assert not set(after) & gone, "an opted-out sample was trained after the resume"
    counts = collections.Counter(after)
    assert max(counts.values()) == 1
    # The restarted epoch is the whole epoch of the new sample space.
    fresh = run_rank(a.root, rank=0, world_size=1, batch_size=8, **KW)
    assert sorted(after) == sorted(flat([fresh]))
    # What repeats is what the first attempt trained, less the opted-out samples (and less
    # any that fall in this epoch's bucket tails).
    assert set(after) & trained == (trained - gone) & set(flat([fresh]))
    assert len(set(after) & trained) >= 16 - len(gone) - 8


def test_weights_changed_since_the_checkpoint_name_the_change(two):
    a, b = two
    kw = dict(KW, epoch_size=200)
    specs = [DatasetSpec(a.root, proportion=0.7), DatasetSpec(b.root, proportion=0.3)]
    first = _first_two_ranks(specs, **kw)
    other = [DatasetSpec(a.root, proportion=0.5), DatasetSpec(b.root, proportion=0.5)]
    with pytest.raises(ResumeMismatch, match=r"a: proportion 0.7 -> 0.5"):
        run_rank(other, rank=0, world_size=1, batch_size=8, state=first[0].state, **kw)
    # Replication reorders the epoch: named too (same data-parallel global batch of 8).
    with pytest.raises(ResumeMismatch, match=r"replication: 1 -> 2"):
        run_rank(
            specs, rank=0, world_size=2, batch_size=8, replication=2, state=first[0].state, **kw
        )
    # The same datasets and weights resume on another world size without complaint.
    again = run_rank(specs, rank=0, world_size=1, batch_size=8, state=first[0].state, **kw)
    full = run_rank(specs, rank=0, world_size=1, batch_size=8, **kw)
    # a is up-sampled (140 of 109), so compare as multisets: the epoch, exactly.
    assert collections.Counter(flat(first) + flat([again])) == collections.Counter(flat([full]))


def test_a_checkpoint_without_fingerprint_resumes_with_a_warning(two, caplog):
    a, _ = two
    first = _first_two_ranks(a.root, **KW)
    state = {k: v for k, v in first[0].state.items() if k != "prx_fingerprint"}
    with caplog.at_level(logging.WARNING, logger="prx_data.stream.dataset"):
        rest = run_rank(a.root, rank=0, world_size=1, batch_size=8, state=state, **KW)
    assert "has no fingerprint" in caplog.text
    assert not set(flat(first)) & set(flat([rest]))


def test_each_bucket_streams_its_own_decision_whatever_the_plan_order(two, monkeypatch):
    """Decisions are looked up by (dataset, bucket), never paired with the buckets by position."""
    from prx_data.stream import planner, sources

    real = planner.plan_buckets

    def reversed_plan(*args, **kwargs):
        plan = real(*args, **kwargs)
        plan.buckets.reverse()
        return plan

    monkeypatch.setattr(sources.planner, "plan_buckets", reversed_plan)
    a, b = two
    run = run_rank(
        [DatasetSpec(a.root, choose=140), DatasetSpec(b.root, choose=60)],
        rank=0,
        world_size=1,
        batch_size=4,
        num_workers=0,
        tier=512,
        small_buckets="drop",
    )
    seen = flat([run])
    assert abs(_share(seen, "a") - 140) <= 4 and abs(_share(seen, "b") - 60) <= 4
    assert all(len(s) == 1 for s in run.shapes), "a batch mixed shapes"


def test_a_plan_naming_one_bucket_twice_is_refused():
    from prx_data.stream import planner

    counts = [planner.DatasetCount("a", [planner.BucketCount("512/1.000", 64, 0)])]
    plan = planner.plan_buckets(counts, planner.PlanSpec(tier=512, device_batch_size=4))
    assert set(plan.decisions()) == {(0, "512/1.000")}
    plan.buckets.append(plan.buckets[0])
    with pytest.raises(planner.PlanError, match="twice"):
        plan.decisions()
