"""Derived state is bound to content, not to where rows sit in the table.

A table compacted (``python -m prx_data.table compact``) or ingested again and
exported again with ``--overwrite`` writes the same bytes under the same part
names, so the latents made for the first export still verify and are not
encoded again, and a checkpoint's data state resumes exactly. A checkpoint's
fingerprint keys skip lists and the hold-out by each shard's content, not by
its folder, and sees the shards' order.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from prx_data.pipelines.latents import LatentsConfig, run_latents
from prx_data.pipelines.write_mds import run_export

from prx_data.core.runtime import RunOptions
from prx_data.export import layout, naming
from prx_data.export.layout import ShardInfo, content_digest
from prx_data.export.spec import ExportConfig
from prx_data.export.verify import verify_export
from prx_data.stream import resume
from prx_data.stream.spec import shard_digest, shards_digest
from prx_data.table import lance_ops
from tests.tablekit import make_table

B = "512/1.000"
N_ROWS = 12


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (600, 600), (20 * i % 255, 200 - 10 * i, 7)).save(buf, "JPEG")
    return buf.getvalue()


def _table(tmp_path) -> str:
    """Twelve photos of one bucket in three fragments of four rows."""
    uri = str(tmp_path / "t.lance")
    make_table(uri, [(f"s/{i:02d}", _jpeg(i), f"cap {i}") for i in range(N_ROWS)], 4)
    return uri


def _export(table: str, out: str, **kw):
    flags = {k: kw.pop(k) for k in ("overwrite", "resume") if k in kw}
    cfg = ExportConfig(table=table, out=out, tiers=(512,), rows_per_task=2, min_units=1, **kw)
    return run_export(cfg, RunOptions(progress=False), **flags)


def _shard_paths(root: str) -> list[str]:
    return [
        f"{b}/{s.basename}" for b in layout.list_buckets(root) for s in layout.read_index(root, b)
    ]


def _compact(table: str) -> None:
    before = len(lance_ops.open_table(table).get_fragments())
    stats = lance_ops.compact(table)
    assert before == 3 and stats["fragments_after"] == 1  # new fragment ids, same rows


@pytest.mark.parametrize("shard_size", [0, 1 << 26], ids=["unit-parts", "packs"])
def test_a_compacted_table_exports_to_the_same_shard_paths(tmp_path, shard_size):
    table, out = _table(tmp_path), str(tmp_path / "out")
    _export(table, out, shard_size=shard_size)
    paths, digest = _shard_paths(out), content_digest(out)
    assert all(naming.PART_RE.fullmatch(p.split("/")[2]) for p in paths)
    assert not any(p.split("/")[2].startswith("f") for p in paths)  # no fragment ids
    _compact(table)
    _export(table, out, shard_size=shard_size, overwrite=True)
    assert _shard_paths(out) == paths
    assert content_digest(out) == digest  # paths and bytes of every shard, index, manifest


def test_row_ids_repeated_across_units_are_refused_in_one_line(tmp_path):
    """Two units holding the same ids would name the same part: refused, not overwritten."""
    uri = str(tmp_path / "dup.lance")
    make_table(uri, [("a", _jpeg(1), "c"), ("a", _jpeg(1), "c")], 1)
    with pytest.raises(naming.ExportError, match="repeats row ids"):
        _export(uri, str(tmp_path / "out"), shard_size=0)


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    from prx_data.train.vae import save_tiny_autoencoder

    return save_tiny_autoencoder(str(tmp_path_factory.mktemp("vae") / "kl"))


def test_latents_and_a_resume_survive_a_compaction_and_a_re_export(tmp_path, vae):
    from prx_data.stream.dataset import BucketedDataset, DatasetSpec
    from prx_data.stream.holdout import Holdout

    table, out = _table(tmp_path), str(tmp_path / "out")
    _export(table, out, shard_size=4 << 10)  # a few packs
    job = LatentsConfig(
        out=out,
        vae=vae,
        run=RunOptions(progress=False, engine="local"),
    )
    first = run_latents(job)
    assert first.encoded_shards == first.shards > 1

    def dataset() -> BucketedDataset:
        spec = DatasetSpec(root=out, holdout=Holdout(0.25, "eval"))
        return BucketedDataset(
            spec, tier=512, batch_size=2, num_canonical_nodes=1, small_buckets="drop"
        )

    before = dataset()
    state = before.state_dict(2, True)
    _compact(table)
    _export(table, out, shard_size=4 << 10, overwrite=True)
    found = verify_export(out, deep=True)
    assert found.ok, found.problems
    again = run_latents(job)
    assert (again.encoded_shards, again.skipped_shards) == (0, first.shards)
    after = dataset()
    assert after.fingerprint == before.fingerprint
    after.load_state_dict(state)  # exact: no ResumeMismatch


def _info(name: str, samples: int, data: str) -> ShardInfo:
    return ShardInfo(f"{name}/shard.00000.mds", 100 + samples, samples, {"xxh64": data})


def test_the_fingerprint_keys_shards_by_content_and_sees_their_order():
    a, b = _info("f000000-000000000", 4, "aa"), _info("f000001-000000000", 3, "bb")
    # The same shards under other folder names (an export of an older version made again).
    a2, b2 = (
        _info(naming.content_part_name(1), 4, "aa"),
        _info(naming.content_part_name(2), 3, "bb"),
    )
    held = {a.basename: np.array([1, 3]), b.basename: np.array([0])}
    held2 = {a2.basename: np.array([1, 3]), b2.basename: np.array([0])}
    assert shard_digest(held, [a, b]) == shard_digest(held2, [a2, b2])
    assert shard_digest(held, [a, b]) != shard_digest({a.basename: np.array([1])}, [a, b])
    assert shards_digest([a, b]) == shards_digest([a2, b2])
    assert shards_digest([a, b]) != shards_digest([b, a])  # streaming numbers samples by order
    old = {"version": 2, "datasets": [{"root": "r", "samples": 7, "shards": "x"}]}
    new = {"version": 2, "datasets": [{"root": "r", "samples": 7, "shards": "y"}]}
    assert any("its shards changed" in c for c in resume.describe_changes(old, new))
    # A checkpoint of version 1 keyed its digests by folder names: compared by counts alone.
    v1 = {"datasets": [{"root": "r", "samples": 7, "holdout": {"held_out": 2, "digest": "d1"}}]}
    v2 = {"version": 2, "datasets": [{"root": "r", "samples": 7, "shards": "y"}]}
    v2["datasets"][0]["holdout"] = {"held_out": 2, "digest": "d2"}
    assert resume.describe_changes(v1, v2) == []


def test_latents_follow_their_shards_content_to_new_folder_names(tmp_path, vae):
    """The same shards under other part names (an export of an older version made again):
    the latents job moves each .npy to its shard's new key instead of encoding it again."""
    from prx_data.export import latents as L
    from prx_data.export.merge import merge_bucket

    table, out = _table(tmp_path), str(tmp_path / "out")
    _export(table, out, shard_size=0)
    job = LatentsConfig(
        out=out,
        vae=vae,
        run=RunOptions(progress=False, engine="local"),
    )
    first = run_latents(job)
    for bucket in layout.list_buckets(out):
        bdir = os.path.join(out, *bucket.split("/"))
        parts = sorted(p for p in os.listdir(bdir) if naming.PART_RE.fullmatch(p))
        renamed = [naming.part_name(0, 2 * k) for k in range(len(parts))]
        for old, new in zip(parts, renamed, strict=True):
            os.rename(os.path.join(bdir, old), os.path.join(bdir, new))
        merge_bucket(bdir, renamed)
    again = run_latents(job)
    assert (again.encoded_shards, again.skipped_shards) == (0, first.shards)
    record = L.read_record(out)
    for bucket in layout.list_buckets(out):
        index = layout.read_index(out, bucket)
        assert L.stale_shards(record, bucket, index) == []
        assert all(os.path.isfile(L.npy_path(out, L.shard_key(bucket, s.basename))) for s in index)
    assert all(k.split("/")[2].startswith("f") for k in record["shards"])
