"""``skips rewrite --fold-columns``: latents and attached columns written into the shards.

A team on Photoroom PRX's own trainer (``StreamingProcessedDataset``, a plain
``streaming.StreamingDataset``) reads shard columns only. The rewrite folds the
export's ``_latents/`` into ``img_latent`` (VAE moments as PRX reads them: mean and
a zero std on the channel axis, unscaled, since PRX scales what it reads) and each
attached column under its own name. Checked by reading the new shards with
streaming's own dataset: every kept sample's folded values are the stored latent
and the table's value, its image bytes are the source's, skipped samples are gone,
the new export has no ``_latents/`` or ``_columns/`` and ``verify --deep`` passes.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from prx_data.core.runtime import RunOptions
from prx_data.core.streaming_compat import reader_from_json
from prx_data.export import latents as L
from prx_data.export import layout
from prx_data.export.verify import verify_export
from prx_data.skips import rewrite as R
from prx_data.skips.fold import FoldError
from tests.exportkit import make_export, one_rank, skip_samples, upload_tree
from tests.test_attach import _attach, _table

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    from prx_data.train.vae import save_tiny_autoencoder

    return save_tiny_autoencoder(str(tmp_path_factory.mktemp("vae") / "kl"))


def _latents(root: str, vae: str, dtype: str = "float32") -> dict:
    from prx_data.pipelines.latents import LatentsConfig, run_latents

    run = RunOptions(progress=False, engine="local")
    run_latents(LatentsConfig(out=root, vae=vae, run=run, dtype=dtype))
    return L.read_record(root)


def _source(root: str, dtype: str) -> dict[str, tuple[bytes, np.ndarray]]:
    """{id: (image bytes, stored latent as float32)} of every stored sample of the source."""
    out = {}
    for bucket in layout.list_buckets(root):
        for e in layout.read_index_entries(root, bucket):
            part, _, base = e["raw_data"]["basename"].rpartition("/")
            pdir = os.path.join(root, *bucket.split("/"), part)
            reader = reader_from_json(
                pdir, None, {**e, "raw_data": {**e["raw_data"], "basename": base}}
            )
            stored = L.from_stored(L.load_npy(root, f"{bucket}/{part}/{base}", dtype), dtype)
            for i in range(int(e["samples"])):
                item = reader.get_item(i)
                out[item["id"]] = (item["image"], stored[i])
    return out


def _streamed(out: str) -> list[dict]:
    """Every sample of the new export, read by streaming's own dataset, one bucket a stream."""
    from streaming import Stream, StreamingDataset

    items = []
    with one_rank():
        for bucket in layout.list_buckets(out):
            local = os.path.join(out, *bucket.split("/"))
            ds = StreamingDataset(streams=[Stream(local=local)], shuffle=False, batch_size=1)
            items += [ds[i] for i in range(ds.num_samples)]
            del ds
    return items


def test_fold_writes_latents_and_attached_columns_into_the_shards(tmp_path, vae):
    ex = make_export(
        str(tmp_path / "ex"), {B1: 20, B2: 12}, samples_per_part=8, samples_per_shard=5
    )
    record = _latents(ex.root, vae)
    missing = {f"ds/{B1}/3"}
    _attach(ex.root, _table(tmp_path, ex.all_ids(), drop=missing), ("cap2", "score"))
    skipped = {f"ds/{B1}/0", f"ds/{B2}/7"}
    skip_samples(ex.root, "dedup", ids=sorted(skipped))
    source = _source(ex.root, "float32")
    out = str(tmp_path / "folded")

    # Nothing like the threshold's share is skipped: folding is reason enough to rewrite.
    r = R.rewrite_export(ex.root, out, fold_columns=True, progress=False)
    assert r.verified and r.samples_out == len(source) - len(skipped)
    assert not os.path.exists(os.path.join(out, "_latents"))
    assert not os.path.exists(os.path.join(out, "_columns"))
    entry = layout.read_index_entries(out, B1)[0]
    cols = dict(zip(entry["column_names"], entry["column_encodings"], strict=True))
    assert cols["img_latent"] == "ndarray:float32" and cols["cap2"] == "str"
    assert cols["score"] == "float64" and cols["image"] == "bytes"

    vae_rec = record["vae"]
    scale, shift = vae_rec["scaling_factor"], vae_rec.get("shift_factor") or 0.0
    items = _streamed(out)
    assert sorted(i["id"] for i in items) == sorted(set(source) - skipped)
    for it in items:
        image, latent = source[it["id"]]
        assert it["image"] == image  # the JPEG bytes as they were
        mean, std = np.split(it["img_latent"], 2, axis=0)  # PRX: torch.chunk(moments, 2)
        assert not std.any() and mean.shape == latent.shape
        np.testing.assert_allclose(scale * (mean - shift), latent, rtol=1e-5, atol=1e-5)
        if it["id"] in missing:
            assert it["cap2"] == "" and math.isnan(it["score"])
        else:
            assert it["cap2"] == f"new caption of {it['id']}"
            assert it["score"] == pytest.approx(len(it["id"]) / 10)
    assert verify_export(out, deep=True).ok
    assert r.folded_columns == {"cap2": "str", "img_latent": "ndarray:float32", "score": "float64"}

    # A folded export rewrites like any other: its folded columns stay, verify still passes.
    again = str(tmp_path / "again")
    r2 = R.rewrite_export(out, again, force=True, progress=False)
    assert r2.folded_columns == r.folded_columns and r2.samples_out == r.samples_out
    assert {i["id"]: i["cap2"] for i in _streamed(again)} == {i["id"]: i["cap2"] for i in items}
    assert verify_export(again).ok


def test_fold_refuses_stale_latents_and_an_export_with_nothing_to_fold(tmp_path, vae):
    ex = make_export(str(tmp_path / "ex"), {B1: 6}, samples_per_part=6)
    with pytest.raises(FoldError, match="no latents and no attached columns"):
        R.rewrite_export(ex.root, str(tmp_path / "a"), fold_columns=True, progress=False)
    _latents(ex.root, vae, "float16")
    record = L.read_record(ex.root)
    key = next(iter(record["shards"]))
    good = dict(record["shards"][key])
    record["shards"][key]["samples"] += 1  # made from other shard data
    L.write_record(ex.root, record["vae"], record["dtype"], record["shards"])
    with pytest.raises(FoldError, match="missing or stale"):
        R.rewrite_export(ex.root, str(tmp_path / "b"), fold_columns=True, progress=False)

    # Bound to the right shard, but the file's bytes are not the ones the record names.
    record["shards"][key] = good
    L.write_record(ex.root, record["vae"], record["dtype"], record["shards"])
    stored = np.array(L.load_npy(ex.root, key, "float16"))
    L.write_npy(ex.root, key, stored + np.float16(1))
    with pytest.raises(FoldError, match="bytes differ from the latents record"):
        R.rewrite_export(ex.root, str(tmp_path / "c"), fold_columns=True, progress=False)


@pytest.mark.remote
def test_a_remote_export_with_npy_files_is_refused_before_any_work(tmp_path, vae, s3_bucket):
    from prx_data.skips.fold import plan_fold

    ex = make_export(str(tmp_path / "ex"), {B1: 6}, samples_per_part=6)
    _latents(ex.root, vae, "float16")
    remote = f"s3://{s3_bucket}/ex"
    upload_tree(ex.root, remote)
    with pytest.raises(FoldError, match=r"folded from a local export only; copy the export"):
        plan_fold(remote, [B1])
    assert plan_fold(ex.root, [B1]).latent is not None  # the same tree, local, folds


def test_attached_types_fold_to_encodings_plain_readers_decode(tmp_path):
    """Text embeddings and masks as PRX reads them; never pkl; a round trip through MDS."""
    import pyarrow as pa
    from streaming import MDSWriter

    from prx_data.skips.fold import mds_encoding

    emb, mask = pa.list_(pa.list_(pa.float16())), pa.list_(pa.bool_())
    got = {str(t): mds_encoding(t) for t in (pa.string(), pa.int32(), pa.float64(), emb, mask)}
    assert got == {
        "string": "str",
        "int32": "int32",
        "double": "float64",
        str(emb): "ndarray:float16",
        str(mask): "ndarray:uint8",
    }
    assert mds_encoding(pa.struct([("a", pa.int8())])) == "json"
    # Types json cannot write are refused while planning, naming the column, not mid-write.
    for t in (pa.timestamp("us"), pa.binary(), pa.list_(pa.date32())):
        with pytest.raises(FoldError, match=r"^column 'when' is of Arrow type .*attach it again"):
            mds_encoding(t, "when")
    assert mds_encoding(pa.struct([("a", pa.list_(pa.string()))])) == "json"
    for t in (pa.dictionary(pa.int32(), pa.string()), pa.map_(pa.string(), pa.int64())):
        assert mds_encoding(t) == "json"  # categoricals and maps: to_pylist gives json values
    cols = {"latent_caption_t5": "ndarray:float16", "attention_mask_caption_t5": "ndarray:uint8"}
    value = {
        "latent_caption_t5": np.ones((3, 4), np.float16),
        "attention_mask_caption_t5": np.array([1, 1, 0], np.uint8),
    }
    with MDSWriter(out=str(tmp_path / "m"), columns=cols) as w:
        w.write(value)
    import json

    from prx_data.core.streaming_compat import reader_from_json

    entry = json.load(open(tmp_path / "m" / "index.json"))["shards"][0]
    item = reader_from_json(str(tmp_path / "m"), None, entry).get_item(0)
    np.testing.assert_array_equal(item["latent_caption_t5"], value["latent_caption_t5"])
    assert item["attention_mask_caption_t5"].tolist() == [1, 1, 0]
