"""Sidecar skip lists: format, binding to the shard, the sidecar writer, the readers and reports.

The writer is private to the list materialisation; these tests reach it through the test
double :func:`tests.exportkit.skip_samples` (a tree whose sidecars no list log knows).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from prx_data.skips import sidecar as S
from prx_data.skips.log import Provenance
from prx_data.skips.ops import update_list
from prx_data.table.lance_ops import query_ids
from tests.exportkit import FakeExport, make_export, skip_samples

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tpl") / "ex")
    return make_export(root, {B1: 30, B2: 12}, samples_per_part=16, samples_per_shard=5)


@pytest.fixture()
def export(template, tmp_path):
    """A fresh copy of the template export per test (sidecars are written into it)."""
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    return FakeExport(root, template.ids, template.where)


def _sidecar(root, bucket, shard, name):
    return os.path.join(root, bucket, f"{shard}.{name}.skip")


def test_names_are_validated():
    for bad in ["", "Dedup", "a/b", "x.json", "-x", "a b", "x" * 65]:
        with pytest.raises(ValueError, match="invalid skip-list name"):
            S.validate_name(bad)
    assert S.validate_name("optout-2026-11") == "optout-2026-11"


def test_add_is_idempotent_and_merges(export):
    root = export.root
    shard = export.where[f"ds/{B1}/7"][1]
    r = skip_samples(root, "dedup", {(B1, shard): [2, 0, 2]})
    assert (r.shards_written, r.samples_listed) == (1, 2)
    path = _sidecar(root, B1, shard, "dedup")
    first = open(path, "rb").read()
    assert not path.endswith(".json") and first.startswith(S.MAGIC)
    skip_samples(root, "dedup", {(B1, shard): [0, 2]})
    assert open(path, "rb").read() == first
    skip_samples(root, "dedup", {(B1, shard): [4]})
    got = S.load_skips(root, B1, S.read_index(root, B1), ["dedup"])
    assert got[shard].tolist() == [0, 2, 4]
    skip_samples(root, "dedup", {(B1, shard): [1]}, replace=True)
    assert S.load_skips(root, B1, S.read_index(root, B1))[shard].tolist() == [1]


def test_out_of_range_and_unknown_shard(export):
    shard = export.where[f"ds/{B1}/0"][1]
    with pytest.raises(IndexError, match="outside"):
        skip_samples(export.root, "x", {(B1, shard): [99]})
    with pytest.raises(KeyError, match="not in the index"):
        skip_samples(export.root, "x", {(B1, "nope/shard.00000.mds"): [0]})


def test_by_ids_list_stats_remove(export):
    root = export.root
    ids = [f"ds/{B1}/{i}" for i in (0, 5, 6, 29)] + [f"ds/{B2}/3", "missing/id"]
    r = skip_samples(root, "optout", ids=ids)
    assert r.samples_listed == 5 and r.ids_not_found == 1
    skip_samples(root, "nsfw", ids=[f"ds/{B1}/5", f"ds/{B1}/10"])
    # Each id maps back to exactly the shard/index the manifest names.
    for sid in ids[:-1]:
        bucket, shard, idx = export.where[sid]
        assert idx in S.load_skips(root, bucket, S.read_index(root, bucket), ["optout"])[shard]
    lists = S.list_skip_lists(root)
    assert set(lists) == {"optout", "nsfw"} and set(lists["optout"]) == {B1, B2}
    stats = S.skip_stats(root)
    by = {name: {b.bucket: b for b in rows} for name, rows in stats.items()}
    assert by["optout"][B1].skipped == 4 and by["optout"][B2].skipped == 1
    assert by["nsfw"][B2].skipped == 0
    assert by["*"][B1].skipped == 5  # union: id 5 is in both lists
    assert by["*"][B1].percent == pytest.approx(100 * 5 / 30)
    n_files = sum(lists["optout"].values())
    assert skip_samples(root, "optout", remove=True).removed == n_files == 4
    assert set(S.list_skip_lists(root)) == {"nsfw"}


def test_by_query_uses_lance_filter(export, tmp_path):
    import lance
    import pyarrow as pa

    uri = str(tmp_path / "t.lance")
    ids = sorted(export.all_ids())
    lance.write_dataset(
        pa.table({"id": ids, "score": [float(i % 10) for i in range(len(ids))]}), uri
    )
    # ``skips add --table URI --where SQL`` on an export made without a table: export-only.
    r = update_list(
        export.root, "lowscore", query_ids(uri, "score < 2"), Provenance("test"), export_only=True
    )
    expected = {i for n, i in enumerate(ids) if n % 10 < 2}
    assert r.samples_listed == len(expected)
    skipped = set()
    for bucket in (B1, B2):
        shards = S.read_index(export.root, bucket)
        for shard, idx in S.load_skips(export.root, bucket, shards).items():
            skipped |= {
                sid
                for sid, w in export.where.items()
                if w[1] == shard and w[0] == bucket and w[2] in idx
            }
    assert skipped == expected


def _one(export, name="dedup"):
    shard = export.where[f"ds/{B1}/0"][1]
    skip_samples(export.root, name, {(B1, shard): [1, 3]})
    return shard, _sidecar(export.root, B1, shard, name)


def test_corrupt_sidecars_are_refused(export):
    shard, path = _one(export)
    good = open(path, "rb").read()
    shards = S.read_index(export.root, B1)
    cases = {
        b"XXXXXXXX" + good[8:]: "bad magic",
        good[:-1] + bytes([good[-1] ^ 1]): "checksum",
        good[:-4]: "truncated",
        good[:12] + b"[" + good[13:]: "corrupt header",
    }
    for data, msg in cases.items():
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(S.SkipListError, match=msg) as e:
            S.load_skips(export.root, B1, shards)
        assert path in str(e.value)


def test_sidecar_bound_to_its_shard(export):
    shard, path = _one(export)
    shards = S.read_index(export.root, B1)
    info = next(s for s in shards if s.basename == shard)
    # The same list built against different shard content is refused.
    other = S.SkipList(
        "dedup",
        S.ShardInfo(shard, info.bytes + 1, info.samples, info.hashes),
        np.array([1], np.uint32),
    )
    with open(path, "wb") as f:
        f.write(other.to_bytes())
    with pytest.raises(S.SkipListError, match="does not match its shard.*bytes"):
        S.load_skips(export.root, B1, shards)
    bad_hash = {k: "0" * len(v) for k, v in info.hashes.items()}
    with open(path, "wb") as f:
        f.write(
            S.SkipList(
                "dedup",
                S.ShardInfo(shard, info.bytes, info.samples, bad_hash),
                np.array([1], np.uint32),
            ).to_bytes()
        )
    with pytest.raises(S.SkipListError, match="sha1"):
        S.load_skips(export.root, B1, shards)
