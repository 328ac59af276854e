"""Attached columns: a table column joined by id beside an export's shards, served by the loader.

Covers ``python -m prx_data.attach`` (join through the id manifests, a missing id is a
counted null, a rerun computes only what lacks a current file), the loader serving
an attached column as an extra or caption column from a local and an ``s3://``
(moto) export (files fetched into the cache with their shard and evicted with it),
the refusal of a stale or foreign column, and ``verify`` on column files.
"""

from __future__ import annotations

import os
import shutil

import pytest

from prx_data.export import attached as A
from prx_data.stream.spec import DatasetSpec
from tests.exportkit import make_export, one_rank, rank_items, upload_tree

B1, B2 = "512/1.000", "512/0.500"


def _table(tmp_path, ids, *, drop=(), name="t.lance", prefix="new"):
    import lance
    import pyarrow as pa

    ids = [i for i in sorted(ids) if i not in set(drop)]
    uri = str(tmp_path / name)
    lance.write_dataset(
        pa.table(
            {
                "id": ids,
                "cap2": [f"{prefix} caption of {i}" for i in ids],
                "score": [float(len(i)) / 10 for i in ids],
                "label": [i.rsplit("/", 1)[1] for i in ids],
                "caption": ids,
            }
        ),
        uri,
        mode="overwrite",
    )
    return uri


def _attach(out, table, columns=("cap2",), **kw):
    from prx_data.pipelines.attach import AttachConfig, run_attach

    return run_attach(AttachConfig(out=out, table=table, columns=tuple(columns), **kw))


@pytest.fixture
def export(tmp_path):
    ex = make_export(
        str(tmp_path / "ex"), {B1: 40, B2: 24}, samples_per_part=16, samples_per_shard=6
    )
    return ex


def test_a_caption_column_is_joined_by_id_and_streams_as_an_extra_column(tmp_path, export):
    missing = {f"ds/{B1}/3", f"ds/{B2}/20"}
    table = _table(tmp_path, export.all_ids(), drop=missing)
    r = _attach(export.root, table, ("cap2", "score"))
    assert r.shards == r.written_shards > 0 and r.samples == 64
    assert r.missing_ids == len(missing)  # counted once per sample, not per column
    shards = A.read_record(export.root, "cap2")["shards"]
    assert sum(v["missing_ids"] for v in shards.values()) == len(missing)

    items = rank_items(DatasetSpec(export.root), extra_columns=("cap2", "score"))
    assert sorted(i["id"] for i in items) == sorted(export.all_ids())
    for it in items:
        if it["id"] in missing:
            assert it["cap2"] is None and it["score"] != it["score"]  # null; NaN for a float
        else:
            assert it["cap2"] == f"new caption of {it['id']}"
            assert it["score"] == pytest.approx(len(it["id"]) / 10)

    # Chosen as the caption column too, as a shard column would be.
    items = rank_items(DatasetSpec(export.root), caption_columns=("cap2",))
    assert {i["id"]: i["cap2"] for i in items}[f"ds/{B1}/5"] == f"new caption of ds/{B1}/5"


def test_a_rerun_computes_only_shards_that_lack_a_current_file(tmp_path, export):
    table = _table(tmp_path, export.all_ids())
    first = _attach(export.root, table)
    again = _attach(export.root, table)
    assert again.written_shards == 0 and again.skipped_shards == first.shards
    # A file removed, and another column: only those are computed.
    key = sorted(A.read_record(export.root, "cap2")["shards"])[0]
    os.remove(A.file_path(export.root, "cap2", key))
    third = _attach(export.root, table, ("cap2", "label"))
    assert third.written_shards == first.shards  # every shard lacked "label"
    assert third.bytes_written > 0
    rec = A.read_record(export.root, "cap2")["shards"][key]
    assert os.path.getsize(A.file_path(export.root, "cap2", key)) == rec["bytes"]
    assert _attach(export.root, table, ("cap2", "label")).written_shards == 0


def test_a_stale_or_foreign_column_set_is_refused_in_one_line(tmp_path, export):
    from prx_data.export.attached import AttachedError

    table = _table(tmp_path, export.all_ids())
    _attach(export.root, table)
    # The export is made again with other content: the attached files were not made from it.
    make_export(export.root, {B1: 40}, samples_per_part=16, samples_per_shard=5)
    with pytest.raises(AttachedError, match="not made from the current data") as e:
        rank_items(DatasetSpec(export.root), extra_columns=("cap2",))
    assert "\n" not in str(e.value)
    # A rerun computes the changed bucket's shards; then it streams again.
    r = _attach(export.root, table)
    assert r.written_shards > 0
    items = rank_items(DatasetSpec(export.root), extra_columns=("cap2",))
    assert all(i["cap2"] == f"new caption of {i['id']}" for i in items)

    # A file swapped for another shard's (same length, other values): its bytes differ from
    # the record's, refused before a value is served.
    keys = sorted(k for k in A.read_record(export.root, "cap2")["shards"] if k.startswith(B1))
    shutil.copyfile(
        A.file_path(export.root, "cap2", keys[1]), A.file_path(export.root, "cap2", keys[0])
    )
    from prx_data.stream import attached as served

    served._column_file.cache_clear()  # this process read the good file before
    with pytest.raises(AttachedError, match="differ from what the column's record names|more than"):
        rank_items(DatasetSpec(export.root), extra_columns=("cap2",))


def test_verify_reports_a_corrupted_or_stray_column_file(tmp_path, export):
    from prx_data.export.verify import verify_export

    table = _table(tmp_path, export.all_ids())
    _attach(export.root, table)
    assert verify_export(export.root, deep=True).ok
    key = sorted(A.read_record(export.root, "cap2")["shards"])[0]
    path = A.file_path(export.root, "cap2", key)
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF  # same size, other bytes
    open(path, "wb").write(bytes(data))
    assert verify_export(export.root).ok  # sizes agree: only --deep rehashes
    res = verify_export(export.root, deep=True)
    assert [p.path for p in res.problems] == [path]
    assert "xxh64" in res.problems[0].message
    stray = os.path.join(os.path.dirname(path), "shard.99999.arrow")
    open(stray, "wb").write(b"x")
    assert any(p.path.endswith("shard.99999.arrow") for p in verify_export(export.root).problems)


def test_a_column_the_table_lacks_or_a_reserved_name_is_one_line(tmp_path, export):
    from prx_data.core.errors import UsageError

    table = _table(tmp_path, export.all_ids())
    with pytest.raises(UsageError, match="no column"):
        _attach(export.root, table, ("nope",))
    with pytest.raises(UsageError, match="every loader item has"):
        _attach(export.root, table, ("width",))
    with pytest.raises(UsageError, match="already a column of the shards"):
        _attach(export.root, _table(tmp_path, export.all_ids(), name="c.lance"), ("caption",))


def test_remote_columns_come_with_their_shard_into_the_cache_and_leave_with_it(
    tmp_path, export, s3_bucket, moto_server, monkeypatch
):
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    table = _table(tmp_path, export.all_ids(), drop={f"ds/{B2}/7"})
    _attach(export.root, table, ("cap2", "label"))
    root = f"s3://{s3_bucket}/ex"
    upload_tree(export.root, root)
    cache = str(tmp_path / "cache")
    items = rank_items(DatasetSpec(root, local=cache), extra_columns=("cap2", "label"))
    assert sorted(i["id"] for i in items) == sorted(export.all_ids())
    for it in items:
        want = None if it["id"] == f"ds/{B2}/7" else f"new caption of {it['id']}"
        assert it["cap2"] == want and (it["label"] is None) == (want is None)
    cached = [
        os.path.relpath(os.path.join(d, f), cache)
        for d, _, fs in os.walk(cache)
        for f in fs
        if f.endswith(".arrow")
    ]
    # One file per shard and column, in the bucket's cache folder beside its shard.
    n_shards = len(A.read_record(export.root, "cap2")["shards"])
    assert len(cached) == 2 * n_shards
    assert all(c.split(os.sep)[2] == A.COLUMNS_DIR for c in cached)

    # Evicted with its shard: streaming's eviction removes the shard's every file.
    from prx_data.stream import dataset as ps

    with one_rank():
        ds = ps.BucketedDataset(
            DatasetSpec(root, local=cache),
            tier=512,
            batch_size=1,
            shuffle=False,
            num_workers=1,
            extra_columns=("cap2",),
        )
        try:
            reader = ds.shards[0]
            names = [i.basename for i, _ in reader.file_pairs]
            assert len(names) == 2 and A.COLUMNS_DIR in names[1]
            ds.get_item(0)
            local = os.path.join(ds.streams[0].local, names[1])
            assert os.path.isfile(local)
            ds.evict_shard(0)
            assert not os.path.exists(local)
            assert ds.get_item(0)["cap2"] is not None  # fetched again with the shard
            assert os.path.isfile(local)
        finally:
            del ds


def test_remote_latents_stream_from_s3_as_the_local_ones(
    tmp_path, export, s3_bucket, moto_server, monkeypatch
):
    """Precomputed latents of an ``s3://`` export: record read once per node into the cache,
    each shard's ``.npy`` fetched with it; the same latents as the local export serves."""
    import numpy as np
    from prx_data.pipelines.latents import LatentsConfig, run_latents

    from prx_data.core.runtime import RunOptions
    from prx_data.train.vae import save_tiny_autoencoder

    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    vae = save_tiny_autoencoder(str(tmp_path / "vae"))
    run_latents(
        LatentsConfig(
            out=export.root,
            vae=vae,
            dtype="float32",
            run=RunOptions(progress=False, engine="local"),
        )
    )
    root = f"s3://{s3_bucket}/ex"
    upload_tree(export.root, root)
    local = {i["id"]: i["latent"] for i in rank_items(DatasetSpec(export.root), latents=True)}
    cache = str(tmp_path / "cache")
    remote = {
        i["id"]: i["latent"] for i in rank_items(DatasetSpec(root, local=cache), latents=True)
    }
    assert sorted(remote) == sorted(local)
    assert all(np.array_equal(remote[k].numpy(), local[k].numpy()) for k in local)
    from prx_data.export import latents as L

    npys = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".npy")]
    assert len(npys) == len(L.read_record(export.root)["shards"])  # one per shard, in the cache


def test_attach_writes_beside_a_gs_export_and_the_loader_streams_it(tmp_path, export, gs_bucket):
    """The job on an export in object storage (manifests read, files and record written
    there under the job's lease), then streamed back through a node cache."""
    from prx_data.export.verify import verify_export

    root = f"gs://{gs_bucket}/ex"
    upload_tree(export.root, root)
    table = _table(tmp_path, export.all_ids(), drop={f"ds/{B1}/0"})
    r = _attach(root, table, ("cap2",))
    assert r.written_shards == r.shards and r.missing_ids == 1
    assert _attach(root, table, ("cap2",)).written_shards == 0
    assert verify_export(root).ok
    items = rank_items(DatasetSpec(root, local=str(tmp_path / "cache")), extra_columns=("cap2",))
    got = {i["id"]: i["cap2"] for i in items}
    assert got.pop(f"ds/{B1}/0") is None
    assert all(v == f"new caption of {k}" for k, v in got.items())


def test_export_safety_accepts_the_columns_folder_and_never_deletes_it(tmp_path, export):
    """A re-export over the same --out keeps the attached columns (their binding decides)."""
    from prx_data.export.safety import clear_export, foreign_entries

    assert foreign_entries(export.root) == []
    _attach(export.root, _table(tmp_path, export.all_ids()))
    assert foreign_entries(export.root) == []
    clear_export(export.root, sorted(os.listdir(export.root)))
    assert A.read_record(export.root, "cap2") is not None
