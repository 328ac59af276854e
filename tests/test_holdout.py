"""The eval hold-out: the same slice as the per-id definition, computed once per node and cached."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from prx_data.export import layout
from prx_data.stream import holdout as ho
from prx_data.stream.holdout import Holdout
from tests.exportkit import make_export

BUCKETS = {"512/1.000": 40, "512/0.778": 24, "1024/1.000": 8}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("holdout") / "tree"
    return make_export(str(root), BUCKETS, samples_per_part=8, samples_per_shard=3)


def _reference_skips(hold: Holdout, root: str, bucket: str) -> dict[str, np.ndarray]:
    """The hold-out's definition, one id at a time (what every rank computed before)."""
    table = layout.read_manifests(root, [bucket])
    key = hold.salt.encode()[:64]
    out: dict[str, list[int]] = {}
    for shard, index, i in zip(
        table["shard"].to_pylist(),
        table["index"].to_pylist(),
        table["id"].to_pylist(),
        strict=True,
    ):
        v = hashlib.blake2b(i.encode(), digest_size=8, key=key).digest()
        held = int.from_bytes(v, "little") / float(1 << 64) < hold.fraction
        if held == (hold.keep == "train"):
            out.setdefault(shard, []).append(int(index))
    return {k: np.unique(np.asarray(v, np.int64)) for k, v in out.items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fraction,salt", [(0.25, "eval"), (0.5, ""), (0.1, "s" * 80)])
def test_the_slice_equals_the_per_id_definition_on_both_sides(export, fraction, salt):
    for bucket in layout.list_buckets(export.root):
        shards = layout.read_index(export.root, bucket)
        for keep in ("train", "eval"):
            hold = Holdout(fraction, salt, keep)
            assert _same(
                hold.skips(export.root, bucket, shards), _reference_skips(hold, export.root, bucket)
            )


def test_the_vectorised_threshold_matches_the_float_division_exactly():
    rng = np.random.default_rng(3)
    ids = [f"id-{x}-é" for x in rng.integers(0, 1 << 62, 20_000)] + ["", "a" * 300]
    for fraction in (0.01, 0.3, 0.999999):
        hold = Holdout(fraction, "k")
        want = [
            int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8, key=b"k").digest(), "little")
            / float(1 << 64)
            < fraction
            for i in ids
        ]
        assert hold.held_out(ids).tolist() == want


def _shards(root: str) -> dict[str, list]:
    return {b: layout.read_index(root, b) for b in layout.list_buckets(root)}


def test_the_node_leader_computes_once_and_the_other_ranks_and_later_runs_read_it(
    export, tmp_path, monkeypatch
):
    cache = str(tmp_path / "cache")
    hold = Holdout(0.25, "eval", "eval")
    shards = _shards(export.root)
    first = ho.holdout_skips(hold, export.root, export.root, shards, cache, is_leader=True)
    files = [f for f in layout.list_suffix(os.path.join(cache, ho.HOLDOUT_DIR), ".npz")]
    assert len(files) == len(shards)

    def no_manifests(*a, **k):
        raise AssertionError("manifests read again")

    monkeypatch.setattr(ho, "held_set", no_manifests)
    other = ho.holdout_skips(hold, export.root, export.root, shards, cache, is_leader=False)
    again = ho.holdout_skips(
        Holdout(0.25, "eval", "train"), export.root, export.root, shards, cache, is_leader=True
    )
    for b in shards:
        assert _same(other[b][1], first[b][1])
        assert _same(first[b][1], _reference_skips(hold, export.root, b))
        assert _same(again[b][1], _reference_skips(Holdout(0.25, "eval", "train"), export.root, b))


def test_a_changed_export_or_slice_is_computed_again(export, tmp_path, monkeypatch):
    import shutil

    root = str(tmp_path / "tree")
    shutil.copytree(export.root, root)
    cache = str(tmp_path / "cache")
    shards = _shards(root)
    hold = Holdout(0.25, "eval")
    ho.holdout_skips(hold, root, root, shards, cache, is_leader=True)
    calls = []
    real = ho.held_set
    monkeypatch.setattr(ho, "held_set", lambda *a: calls.append(a[2]) or real(*a))
    ho.holdout_skips(hold, root, root, shards, cache, is_leader=True)
    assert calls == []
    report = os.path.join(root, "report.json")
    with open(report, "ab") as f:
        f.write(b"\n")  # a re-export writes a new report
    ho.holdout_skips(hold, root, root, shards, cache, is_leader=True)
    assert sorted(calls) == sorted(shards)
    calls.clear()
    ho.holdout_skips(Holdout(0.3, "eval"), root, root, shards, cache, is_leader=True)
    assert sorted(calls) == sorted(shards)


def test_a_leader_failure_reaches_the_other_ranks_as_one_line(export, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    shards = _shards(export.root)
    hold = Holdout(0.25, "eval")

    def broken(*a):
        raise ho.skiplist.SkipListError("manifests incomplete")

    monkeypatch.setattr(ho, "held_set", broken)
    with pytest.raises(ho.skiplist.SkipListError):
        ho.holdout_skips(hold, export.root, export.root, shards, cache, is_leader=True)
    with pytest.raises(RuntimeError, match="manifests incomplete"):
        ho.holdout_skips(hold, export.root, export.root, shards, cache, is_leader=False, timeout=1)


def test_manifests_that_do_not_match_the_index_are_refused(export, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    root = str(tmp_path / "tree")
    shutil.copytree(export.root, root)
    bucket = "512/1.000"
    rel = layout.list_suffix(layout.rel_join(root, bucket), "ids.parquet")[0]
    path = os.path.join(root, *bucket.split("/"), *rel.split("/"))
    t = pq.read_table(path)
    idx = t["index"].to_numpy().copy()
    idx[1] = idx[0]  # one sample listed twice, another not at all
    pq.write_table(t.set_column(t.schema.get_field_index("index"), "index", [idx]), path)
    shards = layout.read_index(root, bucket)
    with pytest.raises(ho.skiplist.SkipListError, match="once each"):
        Holdout(0.25, keep="eval").skips(root, bucket, shards)


def test_the_resume_fingerprint_holds_the_holdout(export, tmp_path):
    from prx_data.stream.dataset import BucketedDataset, DatasetSpec
    from prx_data.stream.resume import ResumeMismatch

    def ds(salt: str, local: str | None = None) -> BucketedDataset:
        spec = DatasetSpec(root=export.root, local=local, holdout=Holdout(0.25, salt))
        return BucketedDataset(
            spec, tier=512, batch_size=2, num_canonical_nodes=1, small_buckets="drop"
        )

    a = ds("eval", str(tmp_path / "c"))
    assert a.fingerprint["datasets"][0]["holdout"]["salt"] == "eval"
    assert ds("eval").fingerprint == a.fingerprint  # cached or not, the same sample space
    state = a.state_dict(0, True)
    with pytest.raises(ResumeMismatch, match="hold-out 0.25/eval keep train"):
        ds("other").load_state_dict(state)
