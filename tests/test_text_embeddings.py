"""Precomputed text-encoder embeddings as attached columns (``attach --text-encoder``).

Covers the job (each caption column C becomes ``latent_C_<encoder>`` [L, D] and
``attention_mask_C_<encoder>`` [L], equal to the encoder's own output, bound to its
weights digest; a rerun computes nothing; another encoder is refused), the loader
serving them as numpy rows (local and ``s3://``, moto), the trainer's ``text_encoder.source: precomputed``
(same loss as the in-step encoder; another encoder's columns refused in one line),
and ``verify`` on a corrupted column file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prx_data.export import attached as A
from prx_data.export.sample import make_sample_export
from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "train" / "smoke_cpu.yaml"
MAX_LEN = 32
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


def test_embeddings_are_the_encoders_stream_as_arrays_and_a_rerun_does_nothing(tmp_path, t5):
    from prx_data.stream.spec import DatasetSpec
    from prx_data.train.text_encoder import TextEncoder
    from tests.test_attach import _items

    root, table = _export(tmp_path)
    first = _attach(root, table, t5)
    assert first.written_shards == first.shards > 1 and first.samples == 10
    feats_name, mask_name = A.text_names("caption", "tiny_t5")
    assert (feats_name, mask_name) == ("latent_caption_tiny_t5", "attention_mask_caption_tiny_t5")
    rec = A.read_record(root, feats_name)
    assert len(rec["source"]["text_encoder"]["weights"]) == 64

    again = _attach(root, table, t5)
    assert again.written_shards == 0 and again.skipped_shards == first.shards

    enc = TextEncoder.from_pretrained(t5, max_length=MAX_LEN, dtype="float32")
    items = _items(DatasetSpec(root), extra_columns=(feats_name, mask_name))
    assert len(items) == 10
    for it in items:
        feats, mask = it[feats_name], it[mask_name]
        assert feats.shape == (MAX_LEN, enc.hidden_size) and feats.dtype == np.float32
        want_f, want_m = enc.encode([f"caption of {it['id']}"])
        np.testing.assert_allclose(feats, want_f[0].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(mask, want_m[0].numpy().astype(np.uint8))
    empty_f, _ = enc.encode([""])
    np.testing.assert_allclose(A.empty_value(rec), empty_f[0].numpy(), rtol=1e-5, atol=1e-6)


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

    _attach(root, table, t5)
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
    assert _attach(root, table, other, replace=True).written_shards > 0
    with pytest.raises(ConfigError, match="text_encoder.source"):
        load_config(SMOKE, ["text_encoder.source=cached"])


def test_verify_and_the_loader_refuse_a_corrupted_embedding_file(tmp_path, t5):
    from prx_data.export.verify import verify_export
    from prx_data.stream.spec import DatasetSpec
    from tests.test_attach import _items

    root, table = _export(tmp_path)
    _attach(root, table, t5)
    name = A.text_names("caption", "tiny_t5")[0]
    key = sorted(A.read_record(root, name)["shards"])[0]
    path = A.file_path(root, name, key)
    with open(path, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = verify_export(root, deep=True)
    assert any(name in str(p) for p in res.problems), res.problems
    with pytest.raises(A.AttachedError, match="bytes differ"):
        _items(DatasetSpec(root), extra_columns=(name,))


def test_the_step_reads_the_stored_embeddings_and_the_empty_caption_value(tmp_path, t5):
    """With the text path of a trained model (random weights, not the zero-initialised one
    whose first steps ignore the text), the flow loss on one batch from stored embeddings
    equals the in-step encoder's, and changes when the stored empty-caption value does."""
    from prx_data.train.trainer import build_trainer

    root, table = _export(tmp_path)
    _attach(root, table, t5)
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
    from tests.exportkit import upload_tree
    from tests.test_attach import _items

    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    root, table = _export(tmp_path)
    _attach(root, table, t5)
    names = A.text_names("caption", "tiny_t5")
    local = {i["id"]: i for i in _items(DatasetSpec(root), extra_columns=names)}
    remote_root = f"s3://{s3_bucket}/ex"
    upload_tree(root, remote_root)
    remote = _items(DatasetSpec(remote_root, local=str(tmp_path / "cache")), extra_columns=names)
    assert sorted(i["id"] for i in remote) == sorted(local)
    for it in remote:
        for n in names:
            np.testing.assert_array_equal(it[n], local[it["id"]][n])


def test_embeddings_fold_into_the_shards_as_prx_reads_them(tmp_path, t5):
    """``skips rewrite --fold-columns`` writes the stored embeddings and masks into real MDS
    columns (``ndarray``), so PRX's own loader reads them from the shards."""
    from prx_data.skips import rewrite as R
    from tests.test_fold_columns import _streamed

    root, table = _export(tmp_path)
    _attach(root, table, t5)
    feats_name, mask_name = A.text_names("caption", "tiny_t5")
    out = str(tmp_path / "folded")
    r = R.rewrite_export(root, out, fold_columns=True, progress=False)
    assert r.folded_columns[feats_name] == "ndarray:float32"
    assert r.folded_columns[mask_name].startswith("ndarray:")
    from prx_data.train.text_encoder import TextEncoder

    enc = TextEncoder.from_pretrained(t5, max_length=MAX_LEN, dtype="float32")
    items = _streamed(out)
    assert len(items) == 10
    for it in items:
        want_f, want_m = enc.encode([f"caption of {it['id']}"])
        feats = np.asarray(it[feats_name]).reshape(MAX_LEN, enc.hidden_size)
        np.testing.assert_allclose(feats, want_f[0].numpy(), rtol=1e-5, atol=1e-6)
        mask = np.asarray(it[mask_name]).reshape(MAX_LEN)
        np.testing.assert_array_equal(mask, want_m[0].numpy().astype(np.uint8))
