"""on_change="continue": an epoch interrupted by new skip lists finishes in its planned order.

Ranks are simulated in this process (tests.exportkit.run_rank), one rank per node; a
global batch is the union of the ranks' device batches of one step.
"""

from __future__ import annotations

import collections
import logging
import random

import pytest

from prx_data.skips.log import Provenance
from prx_data.skips.ops import update_list
from prx_data.stream.dataset import DatasetSpec, ResumeMismatch
from tests.exportkit import make_export, run_rank, skip_samples

logging.getLogger("streaming").setLevel(logging.ERROR)

# Each bucket's epoch takes a multiple of 8 (the unit) and leaves 7 out: enough to complete any
# short last batch within the epoch.
BUCKETS = {"512/1.000": 63, "512/0.500": 47, "512/2.000": 15}
KW = dict(tier=512, num_canonical_nodes=4, small_buckets="drop")
G = 8  # the data-parallel global batch, kept across resumes


def run(root, world, *, state=None, stop_after=None, **kw):
    """Every rank of one job: its global batches (sets of ids) and rank 0's state."""
    runs = [
        run_rank(
            root,
            rank=r,
            world_size=world,
            batch_size=G // world,
            state=state,
            stop_after=stop_after,
            **KW,
            **kw,
        )
        for r in range(world)
    ]
    steps = len(runs[0].batches)
    assert all(len(r.batches) == steps for r in runs), "ranks disagree on the step count"
    glob = [[i for r in runs for i in r.batches[j]] for j in range(steps)]
    assert all(len(b) == G for b in glob), "a batch is not full"
    assert all(len(s) == 1 for r in runs for s in r.shapes), "a batch mixed shapes"
    return glob, runs[0].state


def bucket(i: str) -> str:
    return i.rsplit("/", 1)[0]


def model(planned, done, gone):
    """Brute force: the planned batches after ``done``, per bucket less ``gone``, cut into
    batches of G placed where their first sample was planned (no list before: a sample's id
    number is its place in its bucket). A bucket's last batch may be short: (its samples,
    how many samples the epoch never planned must complete it)."""
    per = collections.defaultdict(list)
    for bi, b in enumerate(planned[done:], start=done):
        # Within a batch in sample order (the ranks' order depends on the world size).
        row = sorted(b, key=lambda i: int(i.rsplit("/", 1)[1]))
        per[bucket(b[0])] += [(bi, i) for i in row if i not in gone]
    out = []
    for seq in per.values():
        for j in range(0, len(seq), G):
            part = seq[j : j + G]
            out.append((part[0][0], sorted(i for _, i in part), G - len(part)))
    return [(b, need) for _, b, need in sorted(out)]


def check(after, expected, free):
    """``after`` is ``expected`` batch for batch; a short one is completed by distinct samples
    of its bucket from ``free`` (never planned this epoch, not skipped): every remaining sample
    exactly once, every batch full and of one bucket."""
    assert len(after) == len(expected), (len(after), len(expected))
    used = set()
    for got, (want, need) in zip(after, expected, strict=True):
        extra = set(got) - set(want)
        assert set(want) <= set(got) and len(extra) == need, (got, want)
        assert extra <= free and {bucket(i) for i in extra} <= {bucket(want[0])}
        assert not extra & used
        used |= extra
    seen = [i for b in after for i in b]
    assert len(seen) == len(set(seen)), "a sample was trained twice"


@pytest.fixture()
def export(tmp_path):
    return make_export(str(tmp_path / "a"), BUCKETS, name="a", samples_per_shard=7)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_continue_finishes_the_planned_order_without_the_new_list(export, world):
    planned, _ = run(export.root, 1)
    first, state = run(export.root, 2, stop_after=3)
    assert [sorted(b) for b in first] == [sorted(b) for b in planned[:3]]
    trained = {i for b in first for i in b}
    # Removed: two trained samples (nothing happens), the batch planned right after the
    # checkpoint, and a few later ones.
    rest = [i for b in planned[3:] for i in b]
    gone = set(sorted(trained)[:2]) | set(planned[3]) | set(random.Random(5).sample(rest, 5))
    skip_samples(export.root, "optout", ids=gone)
    with pytest.raises(ResumeMismatch):
        run(export.root, world, state=state)
    after, _ = run(export.root, world, state=state, on_change="continue")
    planned_ids = {i for b in planned for i in b}
    free = export.all_ids() - planned_ids - gone
    check(after, model(planned, 3, gone), free)
    seen = {i for b in after for i in b}
    assert not seen & gone and not seen & trained
    assert planned_ids - trained - gone <= seen, "a remaining sample was not trained"


def optout(root, name, ids, grown):
    """Remove ``ids``: in a new list (``name``, sidecars no log knows), or by growing the
    export's logged list 'optout' (its earlier content is rebuilt from the log)."""
    if grown:
        update_list(root, "optout", sorted(ids), Provenance("test"))
    else:
        skip_samples(root, name, ids=ids)


@pytest.mark.parametrize("grown", [False, True])
def test_continue_through_two_changes_on_2_4_1_ranks(export, grown):
    before = set()
    if grown:  # the list is in force from the start (8 samples: 7 still left out per epoch)
        before = set(sorted(i for i in export.all_ids() if "/0.500/" in i)[:8])
        update_list(export.root, "optout", sorted(before), Provenance("test"))
    planned, _ = run(export.root, 1)
    planned_ids = {i for b in planned for i in b}
    first, state = run(export.root, 2, stop_after=2)
    trained = {i for b in first for i in b}
    rest = [i for b in planned[2:] for i in b]
    gone1 = set(planned[2][:3]) | {sorted(trained)[0]} | set(random.Random(1).sample(rest, 4))
    optout(export.root, "optout-1", gone1, grown)
    free = export.all_ids() - planned_ids - before - gone1
    four, state = run(export.root, 4, state=state, stop_after=3, on_change="continue")
    check(four, model(planned, 2, gone1)[:3], free)
    seen4 = {i for b in four for i in b}
    assert not seen4 & (gone1 | trained)
    # With no further change, a continued epoch's checkpoint resumes exactly (default on_change).
    again, _ = run(export.root, 1, state=state, stop_after=2)
    check(again, model(planned, 2, gone1)[3:5], free)
    later = [i for b in planned for i in b if i not in trained | seen4]
    gone2 = set(random.Random(2).sample(later, 5)) | {sorted(seen4)[0]}
    optout(export.root, "optout-2", gone2, grown)
    # A continued epoch's checkpoint refuses a further change by default.
    with pytest.raises(ResumeMismatch):
        run(export.root, 1, state=state)
    one, end = run(export.root, 1, state=state, on_change="continue")
    # Each bucket's trained part is a prefix of its sequence: the rest is the model's
    # sequence less what is gone and what the 4 ranks trained.
    check(one, model(planned, 2, gone1 | gone2 | seen4), free - gone2)
    seen1 = {i for b in one for i in b}
    assert not seen1 & (gone1 | gone2)
    everything = [*trained, *seen4, *seen1]
    assert len(everything) == len(set(everything)), "a sample was trained twice"
    assert planned_ids - gone1 - gone2 <= set(everything), "a remaining sample was not trained"
    # The epoch is over: the next one is the new space's whole epoch.
    nxt, _ = run(export.root, 1, state=end)
    fresh, _ = run(export.root, 1)
    assert sorted(map(sorted, nxt)) == sorted(map(sorted, fresh))


def test_a_short_tail_is_carried_when_the_epoch_planned_its_whole_bucket(tmp_path, caplog):
    """A bucket whose epoch takes all its samples has none to complete a short last batch:
    its tail (under one batch) is carried, reported, and nothing is trained twice."""
    ex = make_export(str(tmp_path / "b"), {"512/1.000": 32, "512/0.500": 24}, name="b")
    planned, _ = run(ex.root, 1)
    assert {i for b in planned for i in b} == ex.all_ids()  # no sample left out
    first, state = run(ex.root, 2, stop_after=2)
    trained = {i for b in first for i in b}
    rest = [i for b in planned[2:] for i in b]
    gone = set(random.Random(3).sample(rest, 3))
    skip_samples(ex.root, "optout", ids=gone)
    with caplog.at_level(logging.WARNING, logger="prx_data"):
        after, _ = run(ex.root, 2, state=state, on_change="continue")
    expected = model(planned, 2, gone)
    full = [(b, need) for b, need in expected if not need]
    check(after, full, set())
    carried = ex.all_ids() - trained - gone - {i for b in after for i in b}
    assert carried == {i for b, need in expected if need for i in b}
    assert 0 < len(carried) < 2 * G
    assert f"0 of them completing a bucket's last batch), {len(carried)} carried" in caplog.text


def test_continue_with_no_change_is_an_ordinary_resume(export):
    """With the mechanism on and nothing changed, a resume is streaming's own, exactly."""
    full, _ = run(export.root, 2)
    first, state = run(export.root, 2, stop_after=3, on_change="continue")
    again, _ = run(export.root, 2, state=state, on_change="continue")
    assert first + again == full  # same world: the same batches, in the same rank order
    one, _ = run(export.root, 1, state=state, on_change="continue")
    assert [sorted(b) for b in one] == [sorted(b) for b in full[3:]]


def test_continue_refuses_a_list_changed_in_place_and_other_changes(export):
    skip_samples(export.root, "dedup", ids=sorted(export.all_ids())[:3])
    _, state = run(export.root, 2, stop_after=2)
    skip_samples(export.root, "dedup", ids=sorted(export.all_ids())[3:5])
    with pytest.raises(ResumeMismatch, match="'dedup' changed in place and its content at the"):
        run(export.root, 1, state=state, on_change="continue")
    with pytest.raises(ResumeMismatch, match="plan cannot be made again"):
        skip_samples(export.root, "dedup", ids=sorted(export.all_ids())[:3], replace=True)
        run(export.root, 1, state=state, on_change="continue", epoch_size=64)


def test_continue_with_dataloader_workers(export):
    """The continued epoch is served by the DataLoader's worker processes as planned."""
    planned, _ = run(export.root, 1, num_workers=2)
    first, state = run(export.root, 1, stop_after=3, num_workers=2)
    rest = [i for b in planned[3:] for i in b]
    gone = set(planned[3][:2]) | set(random.Random(7).sample(rest, 3))
    skip_samples(export.root, "optout", ids=gone)
    after, _ = run(export.root, 2, state=state, on_change="continue", num_workers=2)
    free = export.all_ids() - {i for b in planned for i in b} - gone
    check(after, model(planned, 3, gone), free)


# Proportions: two datasets of 110 samples, an epoch of 160 (each leaves samples out).
MIX_A = {"512/1.000": 63, "512/0.500": 47}
MIX_B = {"512/1.000": 71, "512/0.778": 39}
MIX_KW = dict(epoch_size=160)


def mix(two, pa, pb):
    a, b = two
    return [DatasetSpec(a.root, proportion=pa), DatasetSpec(b.root, proportion=pb)]


def stream(i: str) -> str:
    return i.rsplit("/", 1)[0]  # dataset and bucket


def check_mix_rest(after, planned, done, gone, before, unplanned):
    """Brute force, per bucket of each dataset: what the continued run trained is its
    planned rest (less ``gone`` and what ``before`` trained) in planned order, then, once
    that is used up, samples the epoch never planned; batches full and of one bucket."""
    rest = collections.defaultdict(list)
    for b in planned[done:]:
        for i in sorted(b, key=lambda i: int(i.rsplit("/", 1)[1])):
            if i not in gone and i not in before:
                rest[stream(i)].append(i)
    got = collections.defaultdict(list)
    for b in after:
        assert len({stream(i) for i in b}) == 1, "a batch mixed buckets"
        got[stream(b[0])] += sorted(b, key=lambda i: (i not in rest[stream(i)], i))
    for key, ids in got.items():
        n = len([i for i in ids if i in set(rest[key])])
        assert sorted(ids[:n]) == sorted(rest[key][:n]), key  # a prefix of the planned rest
        if len(ids) > n:
            assert n == len(rest[key]), "unplanned samples before the planned rest was used"
            assert set(ids[n:]) <= unplanned - gone, key


def shares(ids):
    return collections.Counter(i.split("/", 1)[0] for i in ids)


@pytest.fixture()
def two(tmp_path):
    a = make_export(str(tmp_path / "a"), MIX_A, name="a", samples_per_shard=7)
    b = make_export(str(tmp_path / "b"), MIX_B, name="b", samples_per_shard=7)
    return a, b


def test_new_proportions_apply_to_the_rest_counting_what_was_trained(two, caplog):
    planned, _ = run(mix(two, 0.5, 0.5), 1, **MIX_KW)
    assert len(planned) * G == 160
    planned_ids = {i for b in planned for i in b}
    unplanned = (two[0].all_ids() | two[1].all_ids()) - planned_ids
    first, state = run(mix(two, 0.5, 0.5), 2, stop_after=4, **MIX_KW)
    trained = [i for b in first for i in b]
    with pytest.raises(ResumeMismatch, match="proportion 0.5 -> 0.6"):
        run(mix(two, 0.6, 0.4), 2, state=state, **MIX_KW)
    with caplog.at_level(logging.WARNING, logger="prx_data"):
        after, _ = run(mix(two, 0.6, 0.4), 2, state=state, on_change="continue", **MIX_KW)
    seen = [i for b in after for i in b]
    everything = trained + seen
    assert len(everything) == len(set(everything)), "a sample was trained twice"
    check_mix_rest(after, planned, 4, set(), set(trained), unplanned)
    # The whole epoch (what was trained before included) has the new shares, to a batch.
    got = shares(everything)
    assert len(everything) == 160
    assert abs(got["a"] - 0.6 * 160) <= G and abs(got["b"] - 0.4 * 160) <= G, got
    assert f"a requested 0.600, realised {got['a'] / 160:.3f}" in caplog.text


def test_new_proportions_resume_exactly_and_change_again_on_2_4_1_ranks(two):
    planned, _ = run(mix(two, 0.5, 0.5), 1, **MIX_KW)
    planned_ids = {i for b in planned for i in b}
    unplanned = (two[0].all_ids() | two[1].all_ids()) - planned_ids
    first, state = run(mix(two, 0.5, 0.5), 2, stop_after=3, **MIX_KW)
    trained = {i for b in first for i in b}
    gone = set(random.Random(4).sample([i for b in planned[3:] for i in b], 4))
    skip_samples(two[1].root, "optout", ids={i for i in gone if i.startswith("b/")})
    skip_samples(two[0].root, "optout", ids={i for i in gone if i.startswith("a/")})
    new = mix(two, 0.7, 0.3)
    whole, _ = run(new, 2, state=state, on_change="continue", **MIX_KW)
    four, state4 = run(new, 4, state=state, stop_after=3, on_change="continue", **MIX_KW)
    assert [sorted(b) for b in four] == [sorted(b) for b in whole[:3]]
    # No further change: the continued epoch's checkpoint resumes exactly, on 1 rank.
    again, _ = run(new, 1, state=state4, **MIX_KW)
    assert [sorted(b) for b in again] == [sorted(b) for b in whole[3:]]
    check_mix_rest(whole, planned, 3, gone, trained, unplanned)
    # A second change of the weights, continued on 1 rank.
    seen4 = {i for b in four for i in b}
    one, end = run(mix(two, 0.2, 0.8), 1, state=state4, on_change="continue", **MIX_KW)
    seen1 = [i for b in one for i in b]
    everything = [*trained, *seen4, *seen1]
    assert len(everything) == len(set(everything)), "a sample was trained twice"
    assert not set(everything) & gone
    got = shares(everything)
    # b is asked for 128 of 160 but has 110 samples, less 4 gone: it gets all it has, in
    # whole batches per bucket; a fills the rest of the epoch only up to its requested share.
    assert got["b"] > 110 - 4 - 2 * G and got["a"] <= 0.2 * 160 + G, got
    nxt, _ = run(mix(two, 0.2, 0.8), 1, state=end, **MIX_KW)
    fresh, _ = run(mix(two, 0.2, 0.8), 1, **MIX_KW)
    assert sorted(map(sorted, nxt)) == sorted(map(sorted, fresh))


def test_capped_split_never_gives_a_stream_more_than_its_whole_batches():
    from prx_data.stream.midepoch import _capped_split

    assert _capped_split(5, [3, 40, 8], 8) == [0, 4, 1]  # largest remainder
    assert _capped_split(9, [3, 40, 8], 8) == [0, 5, 1]  # all there is
    assert _capped_split(4, [16, 16, 16], 8) == [2, 1, 1]
