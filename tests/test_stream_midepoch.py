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
from prx_data.stream.dataset import ResumeMismatch
from tests.exportkit import make_export, run_rank, skip_samples

logging.getLogger("streaming").setLevel(logging.ERROR)

BUCKETS = {"512/1.000": 61, "512/0.500": 40, "512/2.000": 8}
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
    """Brute force: the planned batches after ``done``, per bucket less ``gone``, in full
    batches placed where their first sample was planned (no list before: a sample's id
    number is its place in its bucket)."""
    per = collections.defaultdict(list)
    for bi, b in enumerate(planned[done:], start=done):
        # Within a batch in sample order (the ranks' order depends on the world size).
        row = sorted(b, key=lambda i: int(i.rsplit("/", 1)[1]))
        per[bucket(b[0])] += [(bi, i) for i in row if i not in gone]
    out = []
    for seq in per.values():
        for j in range(len(seq) // G):
            out.append((seq[j * G][0], sorted(i for _, i in seq[j * G : (j + 1) * G])))
    return [b for _, b in sorted(out)]


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
    assert [sorted(b) for b in after] == model(planned, 3, gone)
    seen = [i for b in after for i in b]
    assert not set(seen) & gone and not set(seen) & trained
    assert len(seen) == len(set(seen))
    planned_ids = {i for b in planned for i in b}
    never = planned_ids - trained - set(seen) - gone
    per_bucket = collections.Counter(map(bucket, never))
    assert all(n < G for n in per_bucket.values()), per_bucket  # a bucket's last partial batch


def optout(root, name, ids, grown):
    """Remove ``ids``: in a new list (``name``, sidecars no log knows), or by growing the
    export's logged list 'optout' (its earlier content is rebuilt from the log)."""
    if grown:
        update_list(root, "optout", sorted(ids), Provenance("test"))
    else:
        skip_samples(root, name, ids=ids)


@pytest.mark.parametrize("grown", [False, True])
def test_continue_through_two_changes_on_2_4_1_ranks(export, grown):
    if grown:  # the list is in force from the start, and grows twice
        update_list(export.root, "optout", sorted(export.all_ids())[:2], Provenance("test"))
    planned, _ = run(export.root, 1)
    first, state = run(export.root, 2, stop_after=2)
    trained = {i for b in first for i in b}
    rest = [i for b in planned[2:] for i in b]
    gone1 = set(planned[2][:3]) | {sorted(trained)[0]} | set(random.Random(1).sample(rest, 4))
    optout(export.root, "optout-1", gone1, grown)
    four, state = run(export.root, 4, state=state, stop_after=3, on_change="continue")
    assert [sorted(b) for b in four] == model(planned, 2, gone1)[:3]
    seen4 = [i for b in four for i in b]
    assert not set(seen4) & (gone1 | trained)
    # With no further change, a continued epoch's checkpoint resumes exactly (default on_change).
    again, _ = run(export.root, 1, state=state, stop_after=2)
    assert [sorted(b) for b in again] == model(planned, 2, gone1)[3:5]
    later = [i for b in planned for i in b if i not in trained | set(seen4)]
    gone2 = set(random.Random(2).sample(later, 5)) | {seen4[0]}
    optout(export.root, "optout-2", gone2, grown)
    # A continued epoch's checkpoint refuses a further change by default.
    with pytest.raises(ResumeMismatch):
        run(export.root, 1, state=state)
    one, end = run(export.root, 1, state=state, on_change="continue")
    seen1 = [i for b in one for i in b]
    assert not set(seen1) & (gone1 | gone2)
    everything = [*trained, *seen4, *seen1]
    assert len(everything) == len(set(everything)), "a sample was trained twice"
    never = {i for b in planned for i in b} - set(everything) - gone1 - gone2
    assert all(n < G for n in collections.Counter(map(bucket, never)).values())
    # The epoch is over: the next one is the new space's whole epoch.
    nxt, _ = run(export.root, 1, state=end)
    fresh, _ = run(export.root, 1)
    assert sorted(map(sorted, nxt)) == sorted(map(sorted, fresh))


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
    assert [sorted(b) for b in after] == model(planned, 3, gone)
