"""Precomputed text-encoder embeddings as attached columns (``attach --text-encoder``).

Covers the job (each caption column C becomes ``latent_C_<encoder>`` [L, D] and
``attention_mask_C_<encoder>`` [L], one ``.npy`` per shard in ``--text-dtype``
(bfloat16 by default, as torch rounds the encoder's own output), bound to its
weights digest; a rerun computes nothing; another encoder or dtype is refused), the
loader serving them as numpy rows mapped from the file (local and ``s3://``, moto;
one sample never reads the file), the trainer's ``text_encoder.source: precomputed``
(same loss as the in-step encoder; another encoder's columns refused in one line),
``verify`` and the loader on a corrupted, truncated, foreign or NaN file, and the
Arrow text columns of the previous version (still served; a rerun asks for --replace,
which rewrites them as ``.npy``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from prx_data.export import attached as A
from prx_data.export import bound, npyfile
from prx_data.export.sample import make_sample_export
from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "train" / "smoke_cpu.yaml"
MAX_LEN = 32
HIDDEN = 64  # the tiny T5's d_model
BUCKETS = {"512/1.000": 6, "512/0.778": 4}


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("enc") / "tiny_t5")


def _export(tmp_path) -> tuple[str, str]:
    """An export whose shard captions are ``caption of <id>``, and a table holding the
    same captions (one empty) by id."""
    import lance
    import pyarrow as pa

    root = str(tmp_path / "tree")
    ex = make_sample_export(root, BUCKETS, samples_per_part=4, samples_per_shard=2)
    ids = sorted(ex.all_ids())
    caps = [f"caption of {i}" for i in ids]
    table = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"id": ids, "caption": caps}), table)
    return root, table


def _attach(root, table, t5, **kw):
    """``attach --text-encoder`` of the captions (``text_dtype``: float32 where a test
    compares against the in-step encoder's float32 output)."""
    from prx_data.pipelines.attach import AttachConfig, run_attach

    return run_attach(
        AttachConfig(
            out=root,
            table=table,
            columns=("caption",),
            text_encoder=t5,
            max_length=MAX_LEN,
            **kw,
        )
    )


def _bf16(x: torch.Tensor) -> np.ndarray:
    """float32 values as bfloat16 storage serves them (torch's rounding, back in float32)."""
    return x.to(torch.bfloat16).float().numpy()


def test_embeddings_are_the_encoders_stream_as_arrays_and_a_rerun_does_nothing(tmp_path, t5):
    from prx_data.stream.spec import DatasetSpec
    from prx_data.train.text_encoder import TextEncoder
    from tests.exportkit import rank_items as _items

    root, table = _export(tmp_path)
    first = _attach(root, table, t5)
    assert first.written_shards == first.shards > 1 and first.samples == 10
    feats_name, mask_name = A.text_names("caption", "tiny_t5")
    assert (feats_name, mask_name) == ("latent_caption_tiny_t5", "attention_mask_caption_tiny_t5")
    rec = A.read_record(root, feats_name)
    assert len(rec["source"]["text_encoder"]["weights"]) == 64
    enc = TextEncoder.from_pretrained(t5, max_length=MAX_LEN, dtype="float32")
    # One .npy a shard: bfloat16 bits [samples, L, D], masks uint8 [samples, L].
    assert (rec["kind"], rec["dtype"], rec["shape"]) == ("npy", "bfloat16", [MAX_LEN, HIDDEN])
    mrec = A.read_record(root, mask_name)
    assert (mrec["kind"], mrec["dtype"], mrec["shape"]) == ("npy", "uint8", [MAX_LEN])
    for key, entry in rec["shards"].items():
        path = A.file_path(root, feats_name, key, "npy")
        assert path.endswith(".npy") and os.path.getsize(path) == entry["bytes"]
        arr = np.load(path, allow_pickle=False)
        assert arr.dtype == np.uint16 and arr.shape == (entry["samples"], MAX_LEN, HIDDEN)
        mask = np.load(A.file_path(root, mask_name, key, "npy"), allow_pickle=False)
        assert mask.dtype == np.uint8 and mask.shape == (entry["samples"], MAX_LEN)
    assert not [f for f in _files(root) if f.endswith(".arrow")]

    again = _attach(root, table, t5)
    assert again.written_shards == 0 and again.skipped_shards == first.shards

    items = _items(DatasetSpec(root), extra_columns=(feats_name, mask_name))
    assert len(items) == 10
    for it in items:
        feats, mask = it[feats_name], it[mask_name]
        assert feats.shape == (MAX_LEN, enc.hidden_size) and feats.dtype == np.float32
        want_f, want_m = enc.encode([f"caption of {it['id']}"])
        np.testing.assert_array_equal(feats, _bf16(want_f[0]))
        np.testing.assert_array_equal(mask, want_m[0].numpy().astype(np.uint8))
    empty_f, _ = enc.encode([""])
    np.testing.assert_array_equal(A.empty_value(rec), _bf16(empty_f[0]))

    # Another storage dtype is another column: refused in one line, made again with --replace.
    with pytest.raises(A.AttachedError, match="npy bfloat16 .* writes npy float16") as err:
        _attach(root, table, t5, text_dtype="float16")
    assert "\n" not in str(err.value) and "--replace" in str(err.value)
    assert _attach(root, table, t5, text_dtype="float16", replace=True).written_shards > 0
    for it in _items(DatasetSpec(root), extra_columns=(feats_name,)):
        want_f, _ = enc.encode([f"caption of {it['id']}"])
        np.testing.assert_array_equal(it[feats_name], want_f[0].half().float().numpy())


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def _other_encoder(tmp_path, t5) -> str:
    """The tiny T5 with other weights (same class, config and tokenizer)."""
    from transformers import ByT5Tokenizer, T5EncoderModel

    torch.manual_seed(1)
    model = T5EncoderModel(T5EncoderModel.from_pretrained(t5).config)
    other = str(tmp_path / "tiny_t5")
    model.save_pretrained(other)
    ByT5Tokenizer().save_pretrained(other)
    return other


def _trainer_cfg(tmp_path, root, t5, source, run, extra=()):
    return load_config(
        SMOKE,
        [
            *tiny_overrides(t5, max_length=MAX_LEN),
            f"text_encoder.source={source}",
            f"variables.data_root={root}",
            f"variables.run_name={run}",
            f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
            "trainer.autoresume=false",
            "trainer.max_duration=3ba",
            "trainer.save_interval=3ba",
            "data.caption_dropout=0.5",
            "data.plan.include_higher_tiers=false",
            "eval.enabled=false",
            "sampling.enabled=false",
            "metrics.enabled=false",
            "logging.log_to_console=false",
            *extra,
        ],
    )


def test_precomputed_text_gives_the_in_step_loss_and_another_encoder_is_refused(
    tmp_path, t5, monkeypatch
):
    from prx_data.train.text_encoder import TextEncoder
    from prx_data.train.trainer import build_trainer
    from tests.test_latents import _fit_losses

    root, table = _export(tmp_path)
    with pytest.raises(ConfigError, match="no attached column 'latent_caption_tiny_t5'") as err:
        build_trainer(_trainer_cfg(tmp_path, root, t5, "precomputed", "none"))
    assert "\n" not in str(err.value) and "--text-encoder" in str(err.value)

    _attach(root, table, t5, text_dtype="float32")
    encoded = _fit_losses(_trainer_cfg(tmp_path, root, t5, "encode", "enc"))

    def refuse(*args, **kwargs):
        raise AssertionError("the text encoder ran with text_encoder.source: precomputed")

    from prx_data.train.captions import CaptionPolicy

    picks: list[int] = []
    choose_index = CaptionPolicy.choose_index

    def record(self, batch, generator=None):
        out = choose_index(self, batch, generator)
        picks.extend(out)
        return out

    with monkeypatch.context() as m:
        m.setattr(TextEncoder, "encode", refuse)
        m.setattr(CaptionPolicy, "choose_index", record)
        stored = _fit_losses(_trainer_cfg(tmp_path, root, t5, "precomputed", "pre"))
    assert len(encoded) == len(stored) == 3
    assert -1 in picks and 0 in picks  # dropped captions took the record's empty value
    np.testing.assert_allclose(stored, encoded, rtol=1e-5, atol=1e-7)

    # Another encoder's weights (same name, class and config): the trainer and the job refuse.
    other = _other_encoder(tmp_path / "other", t5)
    with pytest.raises(ConfigError, match=r"another text encoder \(weights ") as err:
        build_trainer(_trainer_cfg(tmp_path, root, other, "precomputed", "other"))
    assert "\n" not in str(err.value) and "--replace" in str(err.value)
    with pytest.raises(A.AttachedError, match="another text encoder") as err:
        _attach(root, table, other)
    assert "\n" not in str(err.value)
    assert _attach(root, table, other, replace=True, text_dtype="float32").written_shards > 0
    with pytest.raises(ConfigError, match="text_encoder.source"):
        load_config(SMOKE, ["text_encoder.source=cached"])


def _flip(path: str, at: int, value: bytes | None = None) -> None:
    """Overwrite bytes of ``path`` at ``at`` in place (same size): ``value``, or the byte
    there with its bits flipped."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(value if value is not None else bytes([byte[0] ^ 0xFF]))


def test_verify_the_loader_and_the_fold_refuse_a_bad_embedding_file_in_one_line(tmp_path, t5):
    """A flipped data byte (same size): ``verify --deep`` and the fold (which read the whole
    file) find it by its xxh64; the loader, which maps one row, does not read the rest.
    A truncated file, a foreign one (another header) and a NaN in a served row are
    refused by the loader in one line."""
    from prx_data.export.verify import verify_export
    from prx_data.skips import rewrite as R
    from prx_data.skips.fold import FoldError
    from prx_data.stream.spec import DatasetSpec
    from tests.exportkit import rank_items as _items

    root, table = _export(tmp_path)
    _attach(root, table, t5)
    name = A.text_names("caption", "tiny_t5")[0]
    rec = A.read_record(root, name)
    key = sorted(rec["shards"])[0]
    path = A.file_path(root, name, key, "npy")
    good = open(path, "rb").read()
    header = len(good) - rec["shards"][key]["samples"] * MAX_LEN * HIDDEN * 2
    assert verify_export(root, deep=True).ok

    def refused(match: str) -> str:
        with pytest.raises(A.AttachedError, match=match) as err:
            _items(DatasetSpec(root), extra_columns=(name,))
        assert "\n" not in str(err.value)
        return str(err.value)

    _flip(path, header + 200)
    res = verify_export(root, deep=True)
    assert any(name in str(p) and "xxh64" in str(p) for p in res.problems), res.problems
    with pytest.raises(FoldError, match="bytes differ") as err:
        R.rewrite_export(root, str(tmp_path / "folded"), fold_columns=True, progress=False)
    assert "\n" not in str(err.value)

    with open(path, "wb") as f:  # truncated
        f.write(good[:-100])
    assert "--replace" in refused("bytes, its record names")
    with open(path, "wb") as f:  # foreign: float16 values in the same bytes
        f.write(good.replace(b"'<u2'", b"'<f2'", 1))
    refused("holds float16, the .* record says bfloat16")
    with open(path, "wb") as f:
        f.write(good)
    nan = np.array([0x7FC0], "<u2").tobytes()  # bfloat16 NaN, in row 1
    _flip(path, header + MAX_LEN * HIDDEN * 2 + 6, nan)
    refused("sample 1: holds NaN")


def test_one_sample_is_read_from_a_map_whatever_the_files_size(tmp_path, monkeypatch):
    """A shard's embeddings far past the old 1 GiB cap of a whole-file read (a sparse file,
    T5Gemma's shape): checked by its header and its record's byte count and served a row at
    a time, without a whole-file read."""
    from prx_data.core import confined

    def no_read(*args, **kwargs):
        raise AssertionError("a whole-file read of an npy column")

    monkeypatch.setattr(confined.Confined, "read", no_read)
    samples, shape = 1500, (256, 2304)
    path = str(tmp_path / "shard.00000.npy")
    head = np.lib.format.header_data_from_array_1_0(np.zeros((0,), "<u2"))
    head["shape"] = (samples, *shape)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, head)
        at = f.tell()
        f.truncate(at + samples * int(np.prod(shape)) * 2)
        f.seek(at + 7 * int(np.prod(shape)) * 2)
        f.write(npyfile.to_stored(np.full(shape, 1.5, np.float32), "bfloat16", A.AttachedError))
    size = os.path.getsize(path)
    assert size > 1 << 30
    rec = {"bytes": size, "samples": samples}
    arr = A.open_npy(str(tmp_path), "latent_c_e", rec, "bfloat16", shape, (str(tmp_path), path))
    row = A.npy_row(arr, 7, "bfloat16", path)
    assert row.dtype == np.float32 and row.shape == shape and (row == 1.5).all()
    assert (A.npy_row(arr, 8, "bfloat16", path) == 0).all()
    with pytest.raises(A.AttachedError, match="its record names"):
        A.open_npy(
            str(tmp_path), "c", {**rec, "bytes": size - 2}, "bfloat16", shape, (str(tmp_path), path)
        )


def test_arrow_text_columns_of_the_previous_version_still_stream_and_rerun_as_npy(tmp_path, t5):
    """Text columns written as Arrow fixed-size lists (the previous version: no ``kind`` in
    the record) are still served; a rerun refuses them in one line, and ``--replace``
    writes ``.npy`` files and removes the Arrow ones."""
    import pyarrow as pa

    from prx_data.export.verify import verify_export
    from prx_data.stream.spec import DatasetSpec
    from tests.exportkit import rank_items as _items

    root, table = _export(tmp_path)
    _attach(root, table, t5, text_dtype="float32")
    names = A.text_names("caption", "tiny_t5")
    served = {i["id"]: i for i in _items(DatasetSpec(root), extra_columns=names)}
    for name in names:  # as the previous version wrote them
        rec = A.read_record(root, name)
        dtype, shape = A.npy_spec(rec)
        t = pa.float32() if dtype == "float32" else pa.uint8()
        for s in reversed(shape):
            t = pa.list_(t, s)
        for key, entry in rec["shards"].items():
            npy = A.file_path(root, name, key, "npy")
            arr = np.load(npy)
            os.remove(npy)
            flat = pa.array(arr.reshape(-1))
            for s in reversed((arr.shape[0], *shape)[1:]):
                flat = pa.FixedSizeListArray.from_arrays(flat, s)
            data = A.encode(name, flat)
            with open(A.file_path(root, name, key), "wb") as f:
                f.write(data)
            entry.update(bytes=len(data), xxh64=bound.xxh64(data))
        body = {k: v for k, v in rec.items() if k not in ("kind", "dtype", "shape", "format")}
        body["type"] = A.type_text(t)
        A.write_record(root, name, {**body, "version": 1}, body.pop("shards"))
    assert verify_export(root, deep=True).ok
    old = {i["id"]: i for i in _items(DatasetSpec(root), extra_columns=names)}
    for i, it in old.items():
        for n in names:
            np.testing.assert_array_equal(it[n], served[i][n])

    with pytest.raises(A.AttachedError, match="attached as arrow .* writes npy") as err:
        _attach(root, table, t5, text_dtype="float32")
    assert "\n" not in str(err.value) and "--replace" in str(err.value)
    assert _attach(root, table, t5, text_dtype="float32", replace=True).written_shards > 0
    assert not [f for f in _files(root) if f.endswith(".arrow")]
    assert verify_export(root, deep=True).ok
    for it in _items(DatasetSpec(root), extra_columns=names):
        for n in names:
            np.testing.assert_array_equal(it[n], served[it["id"]][n])


def test_the_step_reads_the_stored_embeddings_and_the_empty_caption_value(tmp_path, t5):
    """With the text path of a trained model (random weights, not the zero-initialised one
    whose first steps ignore the text), the flow loss on one batch from stored embeddings
    equals the in-step encoder's, and changes when the stored empty-caption value does."""
    from prx_data.train.trainer import build_trainer

    root, table = _export(tmp_path)
    _attach(root, table, t5, text_dtype="float32")
    trainer = build_trainer(_trainer_cfg(tmp_path, root, t5, "precomputed", "direct"))
    try:
        model = trainer.state.model
        batch = next(iter(trainer.state.train_dataloader))
        assert "latent_caption_tiny_t5" in batch and "attention_mask_caption_tiny_t5" in batch
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.transformer.parameters():
                p.normal_(0.0, 0.2)
        seeds = range(6)
        stored = [model.eval_loss(batch, seed=s) for s in seeds]
        keys, empty = model.stored_text, model.empty_text
        model.stored_text = None
        encoded = [model.eval_loss(batch, seed=s) for s in seeds]
        np.testing.assert_allclose(stored, encoded, rtol=1e-5, atol=1e-7)
        model.stored_text, model.empty_text = keys, (empty[0] + 1.0, empty[1])
        changed = [model.eval_loss(batch, seed=s) for s in seeds]
        assert not np.allclose(changed, stored, rtol=1e-4)  # some seed dropped a caption
    finally:
        trainer.close()


def test_embeddings_stream_from_an_s3_export_as_from_the_local_one(
    tmp_path, t5, s3_bucket, moto_server, monkeypatch
):
    from prx_data.stream.spec import DatasetSpec
    from tests.exportkit import rank_items as _items
    from tests.exportkit import upload_tree

    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    root, table = _export(tmp_path)
    _attach(root, table, t5)
    names = A.text_names("caption", "tiny_t5")
    local = {i["id"]: i for i in _items(DatasetSpec(root), extra_columns=names)}
    remote_root = f"s3://{s3_bucket}/ex"
    upload_tree(root, remote_root)
    cache = tmp_path / "cache"
    remote = _items(DatasetSpec(remote_root, local=str(cache)), extra_columns=names)
    assert sorted(i["id"] for i in remote) == sorted(local)
    # The shards' .npy files were fetched into the cache with them, named by their digest.
    fetched = [f for f in _files(str(cache)) if f.endswith(".npy")]
    assert len(fetched) == 2 * len(A.read_record(root, names[0])["shards"]), fetched
    for it in remote:
        for n in names:
            np.testing.assert_array_equal(it[n], local[it["id"]][n])


def test_embeddings_fold_into_the_shards_as_prx_reads_them(tmp_path, t5):
    """``skips rewrite --fold-columns`` writes the stored embeddings (``.npy``, bfloat16)
    and masks into real MDS columns (``ndarray:float32``, ``ndarray:uint8``), so PRX's own
    loader reads them from the shards."""
    from prx_data.skips import rewrite as R
    from tests.test_fold_columns import _streamed

    root, table = _export(tmp_path)
    _attach(root, table, t5)
    feats_name, mask_name = A.text_names("caption", "tiny_t5")
    out = str(tmp_path / "folded")
    r = R.rewrite_export(root, out, fold_columns=True, progress=False)
    assert r.folded_columns[feats_name] == "ndarray:float32"
    assert r.folded_columns[mask_name] == "ndarray:uint8"
    from prx_data.train.text_encoder import TextEncoder

    enc = TextEncoder.from_pretrained(t5, max_length=MAX_LEN, dtype="float32")
    items = _streamed(out)
    assert len(items) == 10
    for it in items:
        want_f, want_m = enc.encode([f"caption of {it['id']}"])
        feats = np.asarray(it[feats_name])
        assert feats.dtype == np.float32 and feats.shape == (MAX_LEN, enc.hidden_size)
        np.testing.assert_array_equal(feats, _bf16(want_f[0]))  # bfloat16 folds as float32
        mask = np.asarray(it[mask_name]).reshape(MAX_LEN)
        np.testing.assert_array_equal(mask, want_m[0].numpy().astype(np.uint8))


def test_a_tensor_filled_inside_its_npy_bytes_is_the_file_numpy_writes():
    """The job fills each shard's tensor inside the bytes of its own ``.npy`` file (no second
    copy of a shard): those bytes are the file ``np.save`` writes, for every stored dtype."""
    rng = np.random.default_rng(0)
    for dtype in ("bfloat16", "float16", "float32", "uint8"):
        x = rng.standard_normal((3, 5, 7), np.float32)
        want = x.astype(np.uint8) if dtype == "uint8" else npyfile.to_stored(x, dtype, ValueError)
        arr, buf = npyfile.allocate(want.shape, dtype)
        arr[...] = want
        assert buf.dtype == np.uint8 and buf.tobytes() == npyfile.encode(want), dtype


def test_an_encoder_without_weight_files_names_the_setting_it_came_from(tmp_path):
    from prx_data.core.errors import UsageError
    from prx_data.train.vae import weights_digest

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"^--text-encoder: no weight files"):
        weights_digest(str(tmp_path), setting="--text-encoder")
    with pytest.raises(UsageError, match=r"^vae\.name_or_path: no weight files"):
        weights_digest(str(tmp_path))


def test_bfloat16_storage_keeps_every_nan_a_nan_and_rounds_numbers_as_torch():
    from prx_data.core.errors import PrxDataError

    # NaN bit patterns whose rounding would carry into a number, an infinity or zero.
    nans = np.array([0xFFFFFFFF, 0x7FFFFFFF, 0x7F800001, 0x7FC00000], np.uint32).view(np.float32)
    nums = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    x = np.concatenate([nans, nums, np.array([np.inf, -np.inf, 0.0], np.float32)])
    back = npyfile.from_stored(npyfile.to_stored(x, "bfloat16", PrxDataError), "bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.isnan(back), np.isnan(x))
    np.testing.assert_array_equal(back[~np.isnan(x)], want[~np.isnan(x)])
